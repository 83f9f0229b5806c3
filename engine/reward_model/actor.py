"""``task.reward_model.placement=actor``: the reward model in a separate Ray actor (1 CPU and
``task.reward_model.num_gpus`` GPUs), started at its first batch and ended with the run; the
driver sends it (prompt, response) pairs and waits at most ``trainer.ray_timeout_s``."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Optional

from engine.errors import UserError
from engine.rewards.call import Sample
from engine.rewards.scorers import ScorerFailed, finite_scores


class RewardModelActor:
    """Runs inside the actor: loads the model on its GPU (num_gpus > 0) or CPU."""

    def __init__(self, rm_cfg, on_gpu: bool):
        from engine.reward_model.model import RewardModel

        c = rm_cfg
        self.model = RewardModel(c.path, device="cuda" if on_gpu else "cpu", dtype=c.dtype,
                                 batch_size=c.batch_size, max_length=c.max_length, label_index=c.label_index)

    def ready(self) -> dict:
        import os

        return {"pid": os.getpid(), "device": str(self.model.device)}

    def score(self, pairs: list) -> list[float]:
        return self.model.score(pairs)


class ActorRewardModel:
    name = "reward_model"

    def __init__(self, rm_cfg, timeout_s: float):
        self.cfg, self.weight, self.timeout_s = rm_cfg, float(rm_cfg.weight), timeout_s
        self.actor: Optional[object] = None
        self.info: dict = {}

    def describe(self) -> str:
        where = f"{self.cfg.num_gpus:g} GPU" if self.cfg.num_gpus else "CPU"
        return f"{self.weight:g} x {self.name} {self.cfg.path} (Ray actor on {where}, batches of {self.cfg.batch_size})"

    def start(self):
        if self.actor is None:
            import ray

            c = self.cfg
            if os.path.isdir(os.path.expanduser(c.path)):  # the actor may run in another directory (or node)
                c = replace(c, path=os.path.abspath(os.path.expanduser(c.path)))
            cls = ray.remote(num_cpus=1, num_gpus=c.num_gpus)(RewardModelActor)
            self.actor = cls.remote(c, c.num_gpus > 0)
            self.info = self._get(self.actor.ready.remote(), "start")
        return self.actor

    def _get(self, ref, what: str):
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        try:
            return ray.get(ref, timeout=self.timeout_s)
        except GetTimeoutError:
            if what == "start":
                self.close()
                raise UserError(
                    f"The reward-model actor ({self.cfg.path}) did not start within trainer.ray_timeout_s="
                    f"{self.timeout_s:g} s: Ray found no room for it (it needs 1 CPU and {self.cfg.num_gpus:g} GPU "
                    f"besides the ranks'), or loading the model took longer. Free the resources, lower "
                    f"task.reward_model.num_gpus (a fraction shares a GPU), or use "
                    f"task.reward_model.placement=colocated.", title="reward model actor") from None
            raise ScorerFailed(f"the reward-model actor gave no scores within trainer.ray_timeout_s="
                               f"{self.timeout_s:g} s", []) from None
        except RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, UserError):  # e.g. the model does not load: the run stops, whatever the policy
                raise cause from None
            if what == "start":
                raise
            text = str(cause if cause is not None else e).strip().splitlines()
            raise ScorerFailed(f"the reward model failed: {type(cause).__name__}: {text[-1] if text else ''}",
                               []) from None
        except RayActorError as e:
            self.actor = None
            raise UserError(f"The reward-model actor ({self.cfg.path}) died ({type(e).__name__}: its process ended, "
                            f"killed or out of memory). Give it more room (task.reward_model.num_gpus, a smaller "
                            f"task.reward_model.batch_size), or use task.reward_model.placement=colocated.",
                            title="reward model actor lost") from None

    def score(self, samples: list[Sample]) -> list[float]:
        actor = self.start()
        try:
            values = self._get(actor.score.remote([(s.prompt, s.response) for s in samples]), "score")
        except ScorerFailed as e:
            raise ScorerFailed(str(e), range(len(samples))) from None
        try:
            return finite_scores(values, len(samples), f"reward model {self.cfg.path}")
        except ValueError as e:
            raise ScorerFailed(str(e), range(len(samples))) from None

    def close(self) -> None:
        actor, self.actor = self.actor, None
        if actor is not None:
            import ray

            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
