"""What a reward function that asks for ``trainer_state`` receives: where training is, for
reward shaping by progress (TRL passes its ``transformers.TrainerState``; rl passes this, with the
fields such functions read). Imported by spawned reward workers: no torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainerState:
    global_step: int = 0            # RL steps completed before these responses were scored (0 at step 1;
                                    # at validation after step k, k), as TRL counts completed updates
    max_steps: int = 0              # trainer.total_steps (0 outside training: rl eval)
    epoch: float = 0.0              # passes over the training prompts drawn so far (prompts drawn / prompts)
    num_train_epochs: float = 0.0   # passes the run plans (total_steps x data.train_batch_size / prompts)
    is_world_process_zero: bool = True  # rewards are scored on the driver, once

    @property
    def progress(self) -> float:
        """global_step / max_steps (0 outside training)."""
        return self.global_step / self.max_steps if self.max_steps else 0.0
