"""A TRL ``TrainerCallback`` that records each step's wall time and each logged step's metrics
(the rows that carry ``completions/mean_length``), shared by the benches that run TRL beside rl."""

from __future__ import annotations

import time


def step_recorder(times: list, logs: list):
    """A callback appending each step's seconds to ``times`` and each step's log dict to ``logs``."""
    from transformers import TrainerCallback

    class StepRecorder(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                logs_list.append(dict(logs))

    logs_list = logs
    return StepRecorder()
