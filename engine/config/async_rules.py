"""What sampling ahead of the update (trainer.mode=one_step_off|async), updating on prompt groups as
they complete (trainer.mode=streamed), and scoring the rollout as it streams in
(trainer.stream_groups) cannot be combined with, each refused with the reason and the fix
(docs/async.md)."""

from __future__ import annotations

from engine.config.lengths import is_multi_turn
from engine.config.resolved import updates_per_step, versions_ahead
from engine.config.schema import RunConfig
from engine.errors import ConfigError


def check_rollout_ahead(cfg: RunConfig) -> None:
    mode = f"trainer.mode={cfg.trainer.mode}"
    if cfg.algorithm.router_replay != "off":
        raise ConfigError(
            f"`{mode}` with `algorithm.router_replay={cfg.algorithm.router_replay}` is not supported: the rollout "
            f"worker that samples apart from the ranks does not record each token's experts. Use "
            f"trainer.mode=sync, or set algorithm.router_replay=off.", title="invalid config")
    a = cfg.algorithm
    if a.off_policy_ratio == "behavior" and a.rollout_is in ("token", "sequence") and versions_ahead(cfg):
        raise ConfigError(
            f"`algorithm.rollout_is={a.rollout_is}` with `algorithm.off_policy_ratio=behavior` (the default) does "
            f"nothing under `{mode}`: PPO's ratio is then already against the sampler's log-probs, so the weight "
            f"pi_old / pi_rollout is 1. Set algorithm.off_policy_ratio=proximal for decoupled PPO with the truncated "
            f"weight, or drop algorithm.rollout_is.", title="invalid config")


def check_streamed(cfg: RunConfig) -> None:
    """trainer.mode=streamed: one optimizer step over chunks of prompt groups, each group's
    advantages its own, sampled by the torch sampler on the rollout worker (engine/trainer/streamed_update.py)."""
    a, why = cfg.algorithm, None
    if cfg.engine.name != "fsdp":
        why = (f"the streamed update accumulates chunks through the FSDP engine's update loop; "
               f"`engine={cfg.engine.name}` takes a step's micro-batches in one schedule. Use engine=fsdp")
    elif cfg.rollout.name != "torch":
        why = (f"`rollout={cfg.rollout.name}` returns the whole batch from one engine call, so no group comes "
               f"early. Use rollout=torch")
    elif is_multi_turn(cfg):
        why = "multi-turn rollouts (tools or an environment) are not streamed yet. Use trainer.mode=sync"
    elif a.name in ("ppo", "reinforce_pp"):
        why = (f"`algorithm.name={a.name}` needs the whole batch before any advantage "
               + ("(the critic's values and its own update)" if a.name == "ppo" else "(advantages whitened over "
                  "the batch)") + ". Use algorithm.name=grpo, dapo, dr_grpo or rloo, whose advantages are each "
               "group's own")
    elif updates_per_step(cfg) > 1:
        why = (f"the batch makes {updates_per_step(cfg)} optimizer steps (algorithm.ppo_epochs="
               f"{a.ppo_epochs}, algorithm.ppo_mini_batch_size={a.ppo_mini_batch_size}), and only the first could "
               f"start before the rollout ends. Set algorithm.ppo_epochs=1 and algorithm.ppo_mini_batch_size=0 "
               f"(the whole batch)")
    elif cfg.rollout.micro_batch_size % a.rollout_n:
        why = (f"groups are streamed as their samples end, and rollout.micro_batch_size={cfg.rollout.micro_batch_size} "
               f"splits groups of algorithm.rollout_n={a.rollout_n} across chunks. Set rollout.micro_batch_size to "
               f"0 (every row at once) or a multiple of {a.rollout_n}")
    if why:
        raise ConfigError(f"`trainer.mode=streamed` cannot be used here: {why}.", title="invalid config")


def check_stream_groups(cfg: RunConfig) -> None:
    """trainer.stream_groups scores the chunks the torch sampler yields on the ranks (sync mode)."""
    why = None
    if cfg.trainer.mode == "streamed":
        why = ("`trainer.mode=streamed` already scores each prompt group as it ends, and starts the update on "
               "the complete ones. Drop trainer.stream_groups")
    elif cfg.trainer.mode != "sync":
        why = (f"`trainer.mode={cfg.trainer.mode}` already scores each batch the rollout worker returns while "
               f"the ranks update; streaming its groups into the update needs on-policy samples. Drop "
               f"trainer.stream_groups, or use trainer.mode=streamed (on-policy, the update starting on the "
               f"groups that are complete)")
    elif cfg.rollout.name != "torch":
        why = (f"`rollout={cfg.rollout.name}` samples the whole batch in one engine call, so there is no chunk to "
               f"score early. Use rollout=torch, or drop trainer.stream_groups")
    elif is_multi_turn(cfg):
        why = ("multi-turn rollouts (tools or an environment) are scored once the conversation ends. Drop "
               "trainer.stream_groups")
    elif cfg.rollout.micro_batch_size % cfg.algorithm.rollout_n:
        n = cfg.algorithm.rollout_n
        why = (f"it streams each prompt group as its samples end, and rollout.micro_batch_size="
               f"{cfg.rollout.micro_batch_size} splits groups of algorithm.rollout_n={n} across chunks. Set "
               f"rollout.micro_batch_size to 0 (every row at once) or a multiple of {n}")
    if why:
        raise ConfigError(f"`trainer.stream_groups=true` cannot be used here: {why}.", title="invalid config")
