"""Everything the driver prepares before ranks start: task, tokenizer, encoded prompts."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.lengths import is_multi_turn, sampler_context
from engine.config.schema import RunConfig
from engine.errors import ConfigError
from engine.tasks.base import Task


@dataclass
class RunInputs:
    task: Task
    tokenizer: object
    train_prompts: list[list[int]]
    val_prompts: list[list[int]]
    model_path: str
    vocab: dict      # {"size", "pad", "eos"}
    rewards: object = None  # engine.rewards.compute.RewardRunner (close() it when the run ends)
    agent: object = None    # engine.agents.setup.AgentSetup: multi-turn rollouts (None: single-turn)


def resolve_model_path(cfg: RunConfig) -> str:
    """The local HF directory the run trains ("" = tiny built-in model), checked against the
    engine: every model.path problem is a ConfigError here, before any run directory exists."""
    from engine.model.presets import resolve_model_path as resolve_preset

    path = resolve_preset(cfg.model)
    if path:
        from engine.model.source import HF_LOAD_KWARGS, check_architecture

        check_architecture(path)
        if cfg.engine.name == "megatron":  # megatron converts only the architectures it maps
            from transformers import AutoConfig

            from engine.backends.megatron.model import arch_from_hf_config

            arch_from_hf_config(AutoConfig.from_pretrained(path, **HF_LOAD_KWARGS))  # raises ConfigError
    if cfg.algorithm.router_replay != "off":
        from engine.moe.routers import check_replay_model

        check_replay_model(path, cfg.algorithm.router_replay)
    return path


def resolve_critic_path(cfg: RunConfig, vocab_size: int) -> str:
    """The local HF directory of ``critic.model_path`` ("" = the critic starts from the policy's
    initial network), checked like model.path, plus what the critic needs of it: it reads the
    policy's token ids, so its embedding must have a row for each of them."""
    if cfg.algorithm.name != "ppo" or not cfg.critic.model_path:
        return ""
    from engine.model.source import check_architecture, read_config_json, resolve_path_or_hub_id

    path = resolve_path_or_hub_id(cfg.critic.model_path, key="critic.model_path")
    check_architecture(path)
    raw = read_config_json(path)
    vocab = raw.get("vocab_size", (raw.get("text_config") or {}).get("vocab_size"))
    if isinstance(vocab, int) and vocab < vocab_size:
        raise ConfigError(
            f"`critic.model_path={cfg.critic.model_path}` has a vocabulary of {vocab:,} tokens; the policy's "
            f"tokenizer has {vocab_size:,}, and the critic reads the policy's token ids. Use a critic of the same "
            f"model family as the policy (the same tokenizer), or unset critic.model_path to start the critic "
            f"from the policy's initial network.", title="invalid model")
    if cfg.engine.name == "megatron":  # megatron converts only the architectures it maps
        from transformers import AutoConfig

        from engine.backends.megatron.model import arch_from_hf_config, check_parallel_layout
        from engine.model.source import HF_LOAD_KWARGS

        check_parallel_layout(arch_from_hf_config(AutoConfig.from_pretrained(path, **HF_LOAD_KWARGS)),
                              cfg.engine.tensor_model_parallel_size)  # raises ConfigError
    return path


def check_model_fits_run(cfg: RunConfig, model_path: str, vocab: dict) -> None:
    """What the policy's transformers config must allow, refused before any rank starts (each
    was an error inside a rank): vLLM's head sizes, LoRA target modules, megatron's TP split."""
    lora = cfg.model.lora
    if cfg.rollout.name != "vllm" and not (lora.rank and lora.target_modules) and cfg.engine.name != "megatron":
        return
    from engine.rollout.vllm_sampler import check_vllm_config, head_dim_of, hf_config_for

    hf_config = hf_config_for(cfg, model_path, vocab)
    if cfg.rollout.name == "vllm":
        from engine.trainer.ray_cluster import ranks_elsewhere

        # on another machine's ranks the device is theirs: with trainer.device=auto, their own check decides
        elsewhere = ranks_elsewhere(cfg.trainer.ray_address) and cfg.trainer.device != "cpu"
        check_vllm_config(cfg, head_dim_of(hf_config), on_cpu=False if elsewhere else None)
    if lora.rank and lora.target_modules:
        from engine.model.lora import check_targets

        check_targets(lora, hf_config)
    if cfg.engine.name == "megatron":
        from engine.backends.megatron.model import arch_from_hf_config, check_parallel_layout

        check_parallel_layout(arch_from_hf_config(hf_config), cfg.engine.tensor_model_parallel_size,
                              cfg.engine.expert_model_parallel_size)


def prepare_inputs(cfg: RunConfig) -> RunInputs:
    from engine.model.tokenizer import CharTokenizer, HFTokenizer
    from engine.tasks.registry import make_task

    task = make_task(cfg.task, cfg.trainer.seed)
    model_path = resolve_model_path(cfg)
    if model_path:
        tok = HFTokenizer(model_path)
    else:
        if not task.alphabet:
            raise ConfigError(f"task={cfg.task.name} needs a real tokenizer: set model.path=/path/to/hf-model "
                              f"or a model preset (e.g. model=smollm2-135m).", title="invalid config")
        tok = CharTokenizer(task.alphabet)
    from engine.data.prompts import encode_split

    enc = {split: encode_split(tok, examples, split=split, max_len=cfg.data.max_prompt_length,
                               filter_overlong=cfg.data.filter_overlong_prompts, chat_template=cfg.task.chat_template)
           for split, examples in (("train", task.train), ("held-out", task.val))}
    task.train, task.val = enc["train"].examples, enc["held-out"].examples
    train, val = enc["train"].ids, enc["held-out"].ids
    from engine.agents.setup import agent_setup

    agent = agent_setup(cfg, tok, task.tools, task.environment)
    if agent is not None:  # a chat template shows the model the tools' schemas
        train, val = agent.encode_prompts(task.train, train), agent.encode_prompts(task.val, val)
    task.data_info["dropped_overlong"] = {k: len(v.dropped) for k, v in enc.items()}
    limit, limit_key = cfg.model.max_position_embeddings, "model.max_position_embeddings"
    if model_path:
        from engine.model.source import check_vocab, context_length

        check_vocab(model_path, tok, train + val)
        limit, limit_key = context_length(model_path)  # a model directory's own positions (GPT-2: n_positions)
    after = sampler_context(cfg) - cfg.data.max_prompt_length  # the response, or a trajectory + one turn
    if limit and cfg.data.max_prompt_length + after > limit:
        longest = max(len(p) for p in train + val)
        if longest + after > limit:
            keep = max(limit - after, 0)
            what, lower = ((f"rollout.max_new_tokens ({after})", "rollout.max_new_tokens") if not is_multi_turn(cfg)
                           else (f"a trajectory ({after} tokens: the budget rollout.max_trajectory_tokens, or "
                                 f"max_turns x max_new_tokens, and one turn more)", "rollout.max_trajectory_tokens"))
            raise ConfigError(f"prompt ({longest} tokens) + {what} "
                              f"exceeds {limit_key} ({limit}): the model has no positions past {limit}. Shorten the "
                              f"prompts, lower {lower}, or drop the long ones with "
                              f"data.max_prompt_length={keep} data.filter_overlong_prompts=true.",
                              title="prompt too long")
    vocab = {"size": tok.vocab_size, "pad": tok.pad_token_id, "eos": tok.eos_token_id,
             "ends": list(tok.end_token_ids),  # the model's end tokens, eos first
             "stops": agent.stop_ids if agent is not None else []}
    check_model_fits_run(cfg, model_path, vocab)
    from engine.reward_model.actor import ActorRewardModel
    from engine.reward_model.build import scorers_for
    from engine.rewards.compute import make_runner

    runner = make_runner(task, cfg.task, scorers_for(cfg, tok, make_actor=ActorRewardModel))
    if agent is not None:  # tool calls run where reward functions run (the pool, the timeout)
        agent.use_reward_executors(runner)
    return RunInputs(task, tok, train, val, model_path, vocab, runner, agent)
