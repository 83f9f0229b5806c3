"""verl's and TRL's names for settings rl has under other keys.

Someone coming from verl types ``actor_rollout_ref.rollout.n=8``; from TRL, GRPOConfig's
``num_generations=8``. Neither is an rl key, and the nearest rl key by spelling is usually the wrong
one (``algorithm.adv_estimator`` is closest to ``algorithm.gamma``). This registry maps the
settings users carry over to rl's key, so the error names the right key and the value to set. It
is not an alias layer: rl keeps one name per setting, and the user's override is refused with the
translation (a silently accepted foreign key would hide a difference in meaning where one exists;
those are stated in ``note``).

Names from verl's ``ppo_trainer.yaml`` (``verl/trainer/config``) and TRL's ``GRPOConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ForeignKey:
    tool: str         # "verl" or "TRL"
    rl: str           # rl's key, or a config group (``algorithm``, ``rollout``); "" when none matches one to one
    note: str = ""    # how the meaning or the value differs, or what to do where no key matches
    carries: bool = True  # the value means the same in rl


_A = "actor_rollout_ref.actor."
_V = [  # verl
    ("algorithm.adv_estimator", "algorithm", "the estimator is a preset in rl: `algorithm=grpo|dr_grpo|rloo|"
                                             "reinforce_pp|dapo|ppo` sets its other keys too"),
    ("algorithm.norm_adv_by_std_in_grpo", "algorithm.norm_adv_by_std", ""),
    ("algorithm.use_kl_in_reward", "algorithm.use_kl_loss", "rl puts the KL in the reward when "
                                                             "algorithm.kl_coef > 0 and algorithm.use_kl_loss=false"),
    ("algorithm.kl_ctrl.kl_coef", "algorithm.kl_coef", "with algorithm.use_kl_loss=false, the KL in the reward"),
    ("algorithm.kl_penalty", "algorithm.kl_type", ""),
    ("data.train_files", "task.path", "with task=dataset; Parquet, JSONL, JSON, Arrow or a Hub dataset name"),
    ("data.val_files", "task.val_split", "rl holds out task.num_val rows of task.path, or of the split "
                                         "task.val_split names"),
    ("data.max_response_length", "rollout.max_new_tokens", ""),
    ("data.prompt_key", "task.prompt_key", ""),
    ("actor_rollout_ref.model.path", "model.path", ""),
    ("actor_rollout_ref.model.lora_rank", "model.lora.rank", ""),
    ("actor_rollout_ref.model.lora_alpha", "model.lora.alpha", ""),
    ("actor_rollout_ref.model.target_modules", "model.lora.target_modules", ""),
    ("actor_rollout_ref.model.enable_gradient_checkpointing", "engine.gradient_checkpointing", ""),
    (_A + "optim.lr", "optim.lr", ""),
    (_A + "optim.weight_decay", "optim.weight_decay", ""),
    (_A + "optim.betas", "optim.betas", ""),
    (_A + "optim.lr_warmup_steps", "optim.warmup_steps", ""),
    (_A + "optim.min_lr_ratio", "optim.min_lr_ratio", ""),
    (_A + "optim.warmup_style", "optim.schedule", "constant, cosine or linear after the warm-up"),
    (_A + "optim.lr_scheduler_type", "optim.schedule", "constant, cosine or linear after the warm-up"),
    (_A + "grad_clip", "optim.grad_clip", ""),
    (_A + "ppo_mini_batch_size", "algorithm.ppo_mini_batch_size", "in prompts, as in verl"),
    (_A + "ppo_micro_batch_size_per_gpu", "engine.micro_batch_size", "rows per forward/backward on a rank"),
    (_A + "ppo_max_token_len_per_gpu", "engine.max_tokens_per_micro_batch", "verl's use_dynamic_bsz packing"),
    (_A + "ppo_epochs", "algorithm.ppo_epochs", ""),
    (_A + "clip_ratio", "algorithm.clip_ratio_low", "set algorithm.clip_ratio_high to the same value too"),
    (_A + "clip_ratio_low", "algorithm.clip_ratio_low", ""),
    (_A + "clip_ratio_high", "algorithm.clip_ratio_high", ""),
    (_A + "clip_ratio_c", "algorithm.clip_ratio_c", "dual-clip; off (0) in rl, 3 in verl"),
    (_A + "loss_agg_mode", "algorithm.loss_agg_mode", "the same mode names as verl's"),
    (_A + "entropy_coeff", "algorithm.entropy_coef", ""),
    (_A + "use_kl_loss", "algorithm.use_kl_loss", ""),
    (_A + "kl_loss_coef", "algorithm.kl_coef", "with algorithm.use_kl_loss=true, rl's default"),
    (_A + "kl_loss_type", "algorithm.kl_type", "k1 (verl's kl), k2 (verl's mse), k3 or low_var_kl"),
    (_A + "policy_loss.loss_mode", "algorithm.loss", "ppo_clip or gspo"),
    (_A + "fsdp_config.param_offload", "engine.param_offload", ""),
    (_A + "fsdp_config.optimizer_offload", "engine.optimizer_offload", ""),
    (_A + "megatron.tensor_model_parallel_size", "engine.tensor_model_parallel_size", "with --engine megatron"),
    (_A + "megatron.pipeline_model_parallel_size", "engine.pipeline_model_parallel_size", "with --engine megatron"),
    (_A + "megatron.context_parallel_size", "engine.context_parallel_size", "with --engine megatron"),
    (_A + "megatron.expert_model_parallel_size", "engine.expert_model_parallel_size", "with --engine megatron"),
    (_A + "megatron.sequence_parallel", "engine.sequence_parallel", "with --engine megatron"),
    ("actor_rollout_ref.rollout.n", "algorithm.rollout_n", ""),
    ("actor_rollout_ref.rollout.name", "rollout", "torch or vllm"),
    ("actor_rollout_ref.rollout.temperature", "rollout.temperature", ""),
    ("actor_rollout_ref.rollout.top_p", "rollout.top_p", ""),
    ("actor_rollout_ref.rollout.response_length", "rollout.max_new_tokens", ""),
    ("actor_rollout_ref.rollout.gpu_memory_utilization", "rollout.gpu_memory_utilization", ""),
    ("actor_rollout_ref.rollout.multi_turn.max_assistant_turns", "rollout.max_turns", ""),
    ("critic.optim.lr", "critic.lr", ""),
    ("critic.optim.weight_decay", "critic.weight_decay", ""),
    ("critic.model.path", "critic.model_path", ""),
    ("trainer.total_training_steps", "trainer.total_steps", ""),
    ("trainer.total_epochs", "trainer.total_steps", "rl counts RL steps: an epoch is (training prompts) / "
                                                    "data.train_batch_size steps"),
    ("trainer.save_freq", "checkpoint.save_freq", ""),
    ("trainer.test_freq", "trainer.val_freq", ""),
    ("trainer.default_local_dir", "checkpoint.dir", ""),
    ("trainer.max_actor_ckpt_to_keep", "checkpoint.keep_last", ""),
    ("trainer.n_gpus_per_node", "trainer.ranks_per_node", "and trainer.nprocs = trainer.nnodes x ranks per node"),
    ("trainer.project_name", "trainer.project", ""),
    ("trainer.logger", "trainer.loggers", "a list, e.g. [tensorboard,wandb]"),
    ("trainer.critic_warmup", "critic.warmup_steps", ""),
    ("trainer.resume_mode", "", "rl resumes with its own command: `rl resume RUN_DIR` continues from the run's "
                                "latest complete checkpoint"),
    ("custom_reward_function.path", "task.reward_fn", "file and function together: task.reward_fn=path/to/file.py:fn"),
    ("custom_reward_function.name", "task.reward_fn", "file and function together: task.reward_fn=path/to/file.py:fn"),
    ("reward_model.model.path", "task.reward_model.path", ""),
]
_T = [  # TRL GRPOConfig (and its CLI's model_name_or_path, dataset_name)
    ("model_name_or_path", "model.path", ""),
    ("dataset_name", "task.path", "with task=dataset; a Hub dataset name in the local cache, or a file"),
    ("learning_rate", "optim.lr", ""),
    ("num_generations", "algorithm.rollout_n", ""),
    ("max_completion_length", "rollout.max_new_tokens", ""),
    ("max_prompt_length", "data.max_prompt_length", ""),
    ("beta", "algorithm.kl_coef", "a KL term in the loss, as TRL's: algorithm.use_kl_loss=true, rl's default"),
    ("epsilon", "algorithm.clip_ratio_low", "and algorithm.clip_ratio_high, unless TRL's epsilon_high was set"),
    ("epsilon_high", "algorithm.clip_ratio_high", ""),
    ("loss_type", "algorithm.loss_agg_mode", "TRL's dapo is token-mean, grpo is seq-mean-token-mean, dr_grpo is "
                                             "seq-mean-token-sum"),
    ("scale_rewards", "algorithm.norm_adv_by_std", "true for TRL's group (or True), false for none (or False)"),
    ("num_iterations", "algorithm.ppo_epochs", ""),
    ("temperature", "rollout.temperature", ""),
    ("top_p", "rollout.top_p", ""),
    ("importance_sampling_level", "algorithm.loss", "TRL's token is ppo_clip, sequence is gspo"),
    ("max_grad_norm", "optim.grad_clip", ""),
    ("weight_decay", "optim.weight_decay", ""),
    ("warmup_steps", "optim.warmup_steps", ""),
    ("lr_scheduler_type", "optim.schedule", "constant, cosine or linear"),
    ("max_steps", "trainer.total_steps", ""),
    ("num_train_epochs", "trainer.total_steps", "rl counts RL steps: an epoch is (training prompts) / "
                                                "data.train_batch_size steps"),
    ("save_steps", "checkpoint.save_freq", ""),
    ("output_dir", "checkpoint.dir", ""),
    ("seed", "trainer.seed", ""),
    ("use_vllm", "rollout", "rollout=vllm"),
    ("report_to", "trainer.loggers", "a list, e.g. [tensorboard,wandb]"),
    ("logging_steps", "trainer.log_freq", ""),
    ("eval_steps", "trainer.val_freq", ""),
    ("per_device_train_batch_size", "data.train_batch_size", "rl's batch is in prompts: TRL's per-device "
                                                             "completions x devices x accumulation / num_generations"),
]
# names whose value means something else in rl (another unit, another spelling, the opposite)
_VALUE_DIFFERS = {"algorithm.use_kl_in_reward", "data.train_files", "data.val_files", _A + "optim.warmup_style",
                  _A + "optim.lr_scheduler_type", "trainer.total_epochs", "trainer.n_gpus_per_node", "trainer.logger",
                  "trainer.resume_mode", "custom_reward_function.path", "custom_reward_function.name", "loss_type",
                  "scale_rewards", "importance_sampling_level", "lr_scheduler_type", "num_train_epochs", "use_vllm",
                  "report_to", "per_device_train_batch_size", "dataset_name"}
FOREIGN_KEYS: dict[str, ForeignKey] = {k: ForeignKey(tool, rl, note, k not in _VALUE_DIFFERS)
                                       for tool, table in (("verl", _V), ("TRL", _T)) for k, rl, note in table}


def foreign_message(key: str, value: str = "") -> str | None:
    """The sentence for a verl or TRL name (``key=value`` as typed), or None when ``key`` is not one."""
    entry = FOREIGN_KEYS.get(key)
    if entry is None:
        return None
    where = "GRPOConfig" if entry.tool == "TRL" else "config"
    said = f"`{key}` is {entry.tool}'s {where} name"
    if not entry.rl:
        return f"{said}; rl has no such key: {entry.note}."
    note = f" ({entry.note})" if entry.note else ""
    if "." not in entry.rl:  # a config group
        from engine.config.load import group_options

        fix = f" Set `{entry.rl}={value}` instead." if entry.carries and value in group_options(entry.rl) else ""
        return f"{said}; in rl it is the `{entry.rl}` group{note}.{fix}"
    fix = f"`{entry.rl}={value}`" if value and entry.carries else f"`{entry.rl}`"
    return f"{said}; in rl it is `{entry.rl}`{note}. Set {fix} instead."


def foreign_config_message(data: dict) -> str | None:
    """For a config mapping (a file's) that holds verl or TRL names: one paragraph translating every
    one of them; None when it holds none."""
    found = []

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            key = f"{prefix}{k}"
            if key in FOREIGN_KEYS:
                found.append((key, v))
            elif isinstance(v, dict):
                walk(v, key + ".")

    walk(data, "")
    if not found:
        return None
    tools = sorted({FOREIGN_KEYS[k].tool for k, _ in found})
    parts = []
    from engine.config.load import group_options

    for key, v in found:
        e = FOREIGN_KEYS[key]
        value = "" if isinstance(v, (dict, list)) or v is None else str(v).lower() if isinstance(v, bool) else str(v)
        if not e.rl:
            parts.append(f"`{key}`: no rl key ({e.note})")
        elif "." not in e.rl:  # a config group: `group: option` in a file
            chosen = f"`{e.rl}: {value}`" if e.carries and value in group_options(e.rl) else f"the `{e.rl}` group"
            parts.append(f"`{key}` -> {chosen}" + (f" ({e.note})" if e.note else ""))
        elif not e.carries or not value:
            parts.append(f"`{key}` -> `{e.rl}`" + (f" ({e.note})" if e.note else ""))
        else:
            parts.append(f"`{key}` -> `{e.rl}: {value}`" + (f" ({e.note})" if e.note else ""))
    return (f"This config uses {' and '.join(tools)}'s names, which rl does not read: rl has one schema "
            f"(`rl config show` prints it, docs/config-reference.md explains every key). In rl: "
            f"{'; '.join(parts)}.")
