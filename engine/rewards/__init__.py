"""Reward computation: which functions score a task (spec), how one call is made (call),
where calls run (serial on the driver, a thread with a timeout, or a spawned process pool),
and the one entry point the trainer uses (compute.RewardRunner.score)."""
