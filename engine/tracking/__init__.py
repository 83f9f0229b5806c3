"""Where a run's metrics, samples and progress go besides the terminal.

One module per logger (``jsonl_logger``, ``tensorboard_logger``, ``wandb_logger``,
``mlflow_logger``), a fan-out (``fanout.Tracking``) that the trainer feeds its events to,
the metric names every logger shares (``names``), sample rows (``samples``), phase progress
events (``progress``), the ids that let ``rl resume`` continue the same runs (``state``) and
the series ``rl plot`` reads back (``series``). Nothing here prints: the CLI renders.
"""
