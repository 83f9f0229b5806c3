"""The run configuration: typed dataclasses, the single source of truth.

YAML under ``configs/`` only sets values of these fields; validation, the generated
reference (docs/config-reference.md) and shell completion all walk these classes.
Every field carries a one-line help in ``metadata["help"]`` and, where it is bounded,
a ``metadata["choices"]`` or ``metadata["min"]``/``["max"]`` (``["above"]``: an exclusive lower
bound) that validation enforces.

A key that only some options of a config group read says so in ``metadata["only_for"]``, e.g.
``{"rollout": ("vllm",)}`` (on a section's field in RunConfig: every key of the section), or of a
choice field, ``{"trainer.mode": ("async",)}``; setting it while another option is chosen is
refused (engine/config/owned_keys.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


def _f(default, help: str, **limits):
    """A dataclass field with help text and optional validation limits."""
    meta = {"help": help, **limits}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


# trainer.omp_wait (engine/threads.py reads it from here)
OMP_WAIT_CHOICES = ("auto", "spin", "passive")


@dataclass
class TrainerConfig:
    total_steps: int = _f(40, "RL steps to run (each: rollout, reward, advantages, update)", min=1)
    nprocs: int = _f(1, "training ranks (data-parallel x model-parallel), one Ray actor each", min=1)
    device: str = _f("auto", "where ranks compute: auto picks cuda when the Ray cluster has GPUs (a local Ray detects this machine's)", choices=["auto", "cpu", "cuda"])
    seed: int = _f(0, "seeds model init, data order and sampling on every rank (fits numpy and torch RNGs)",
                    min=0, max=2**32 - 1)
    val_freq: int = _f(0, "validate (greedy, held-out split) every N steps, plus before and after; 0 = off", min=0)
    log_freq: int = _f(1, "print a step row every N steps", min=1)
    ray_address: str = _f("", "Ray cluster to join: auto, host:6379 or ray://host:10001; empty = RAY_ADDRESS if "
                              "set, else a private local Ray on 127.0.0.1; local = always the private one")
    nnodes: int = _f(0, "nodes the ranks span, ranks_per_node on each (one STRICT_SPREAD bundle per node); "
                        "0 = no constraint: one bundle per rank, placed by trainer.placement", min=0)
    ranks_per_node: int = _f(0, "ranks on each node when nnodes > 0; 0 = nprocs / nnodes", min=0)
    placement: str = _f("PACK", "Ray placement-group strategy for the per-rank bundles (nnodes=0)",
                        choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"])
    ray_timeout_s: float = _f(600.0, "seconds any single Ray call may take before the run is aborted", min=1.0)
    ray_connect_timeout_s: float = _f(60.0, "joining a cluster (trainer.ray_address / RAY_ADDRESS host:port): seconds "
                                            "to wait for its address to accept a connection before the run stops",
                                      min=1.0)
    threads_per_rank: int = _f(0, "torch intra-op threads per rank; 0 = CPU cores divided by nprocs", min=0)
    adapt_threads: bool = _f(False, "with threads_per_rank=0, drop to fewer threads before each rollout and update "
                                    "when other tasks hold the cores (steadier on a shared machine); off by default "
                                    "because float sums then depend on the machine's load, so a run and its resume "
                                    "are no longer bit-reproducible")
    omp_wait: str = _f("auto", "how a rank's idle OpenMP threads wait between ops: spin (~150 us, then sleep: "
                               "the next op starts without a wake-up; ~1.3x faster updates on a quiet CPU), passive "
                               "(sleep at once: steadiest when other work shares the cores), auto = spin when the "
                               "machine has a free core for every rank thread at launch, else passive. "
                               "OMP_WAIT_POLICY / GOMP_SPINCOUNT / KMP_BLOCKTIME set by the user win",
                        choices=list(OMP_WAIT_CHOICES))
    keep_host_heap: bool = _f(True, "ranks keep the host memory a step frees for the next step (glibc malloc: no "
                                    "trimming, no mmap per block under 32 MiB), so steps do not page-fault it in "
                                    "again; resident memory then stays at the step's peak. false = glibc's defaults")
    loggers: list = _f(["console", "jsonl"], "where metrics go: any of console, jsonl (metrics.jsonl), tensorboard, "
                       "wandb, mlflow (the last three need `pip install 'rl[tracking]'`)")
    project: str = _f("rl", "wandb project / MLflow experiment name the run is logged under")
    sample_log_freq: int = _f(10, "every N steps, log sample prompt/response/reward rows (samples.jsonl and "
                              "each logger); 0 = off", min=0)
    sample_log_n: int = _f(4, "how many prompt/response/reward rows each sample log holds", min=1)
    stop_on_alarm: bool = _f(False, "stop cleanly (with a checkpoint) at the first step that raises an alarm "
                                    "(see the alarms section)")
    mode: str = _f("sync", "sync: each step's rollout waits for the previous update (on-policy); one_step_off: the "
                           "next step's rollout runs during this step's update, on the weights before it (every "
                           "sample one version stale); async: rollouts run up to trainer.max_staleness versions "
                           "ahead; streamed: on-policy as sync, the rollout sampled apart from the ranks, which "
                           "update on each chunk of prompt groups as soon as its samples have ended. The modes "
                           "other than sync sample in a separate rollout worker holding its own copy of the "
                           "policy, synced after each update (docs/async.md)",
                   choices=["sync", "one_step_off", "async", "streamed"])
    max_staleness: int = _f(1, "async: how many policy versions a sample may lag the weights it is trained from "
                               "(0 = no rollout ahead: the sync trainer exactly). Each version ahead is a batch "
                               "queued on the rollout worker, and the run's last steps queue theirs too (a resume "
                               "that extends the run trains on them), so at most 32", min=0, max=32,
                            only_for={"trainer.mode": ("async",)})
    stream_chunk_groups: int = _f(0, "streamed: prompt groups per chunk the ranks update on as they complete (each "
                                     "chunk one forward and backward per micro-batch on every rank); 0 = a quarter of "
                                     "data.train_batch_size, at least one row per rank", min=0,
                                  only_for={"trainer.mode": ("streamed",)})
    stream_groups: bool = _f(False, "sync, torch rollout: score each prompt group as soon as all its samples have "
                                    "ended, while the ranks decode the rest; the run is the same as without it, "
                                    "only the reward waits less (docs/async.md)")


@dataclass
class DataConfig:
    train_batch_size: int = _f(32, "prompts per RL step (each sampled algorithm.rollout_n times)", min=1)
    shuffle: bool = _f(True, "reshuffle prompts every epoch (seeded by trainer.seed and the epoch)")
    max_prompt_length: int = _f(64, "prompts longer than this many tokens are rejected at load time", min=1)
    filter_overlong_prompts: bool = _f(False, "drop (and count) prompts longer than max_prompt_length instead of "
                                       "refusing them")


BUILTIN_TASKS = ("echo", "add", "arith", "sort", "tool_add")  # generated prompts, scored by their own rule (engine/tasks)
DATASET_TASKS = ("dataset", "jsonl", "parquet")  # the user's data, one loader (engine/data)


@dataclass
class RewardModelConfig:
    path: str = _f("", "a reward model: a Hugging Face AutoModelForSequenceClassification directory or a hub id in "
                       "the local HF cache (offline); its score of (prompt, response) joins the reward with weight; "
                       "empty = none")
    placement: str = _f("colocated", "colocated: scored in the driver process on the ranks' device (GPU 0 with "
                                     "trainer.device=cuda/auto and a GPU, else CPU); actor: a separate Ray actor "
                                     "holds the model (rl eval scores in its own process)",
                        choices=["colocated", "actor"])
    weight: float = _f(1.0, "weight of the reward model's score in the reward (summed with the functions')")
    batch_size: int = _f(16, "responses scored per forward", min=1)
    max_length: int = _f(1024, "tokens of (prompt, response) the model reads; longer ones lose their start",
                         min=8)
    label_index: int = _f(0, "a model with num_labels > 1: the logit that is the score (TRL reads logits[:, 0])",
                          min=0)
    dtype: str = _f("float32", "dtype of the reward model's weights", choices=["float32", "bfloat16"])
    num_gpus: float = _f(0.0, "placement=actor: GPUs the actor asks Ray for (a fraction shares one); 0 = on CPU",
                         min=0.0)


@dataclass
class TaskConfig:
    name: str = _f("echo", "built-in task, or dataset (jsonl/parquet: the same loader) for your own data",
                   choices=[*BUILTIN_TASKS, *DATASET_TASKS])
    path: str = _f("", "dataset: a Parquet/JSONL/JSON/Arrow file, a save_to_disk or data-file directory, or a "
                       "dataset name in the local Hugging Face cache")
    format: str = _f("auto", "dataset row layout: text (prompt + answer columns), verl (chat prompt, "
                             "reward_model.ground_truth), trl (prompt text or messages; columns reach the reward); "
                             "auto detects it", choices=["auto", "text", "verl", "trl"])
    subset: str = _f("", "dataset: configuration name of a cached Hugging Face dataset (e.g. main for gsm8k)")
    split: str = _f("train", "dataset: split to train on")
    val_split: str = _f("", "dataset: held-out split (first num_val rows); empty holds out rows of the train split")
    reward_fn: str = _f("", "module:function (or rl:<name>, a built-in) scoring (prompt, response, answer, **row); "
                            "cwd is importable")
    reward_fns: list = _f([], "several reward functions (module:function), summed with reward_weights; each is "
                              "logged separately")
    reward_weights: list = _f([], "weights of reward_fns (empty: 1.0 each)")
    reward_batched: bool = _f(False, "reward functions take whole batches, TRL style: "
                                     "fn(prompts, completions, **columns) -> list[float]")
    reward_workers: int = _f(0, "processes scoring rewards in parallel (spawned); 0 = serially on the driver",
                             min=0)
    reward_timeout_s: float = _f(0.0, "seconds one reward call may take before it counts as hung; 0 = no limit",
                                 min=0.0)
    reward_on_error: str = _f("raise", "a reward call that raises or hangs: raise stops the run (last checkpoint "
                                       "intact); zero scores it 0 and counts it", choices=["raise", "zero"])
    correct_fn: str = _f("", "module:function -> bool: exact correctness, reported as accuracy")
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig,
                                            metadata={"help": "a reward model scoring responses (docs/agents.md)"})
    reward_url: str = _f("", "a remote scorer: http(s) URL that batches of samples are POSTed to as JSON "
                             "(docs/agents.md); its scores join the reward with reward_url_weight; empty = none")
    reward_url_weight: float = _f(1.0, "weight of the remote scorer's scores in the reward")
    reward_url_timeout_s: float = _f(60.0, "seconds one request to task.reward_url may take (connect, then "
                                           "read); a timed-out request is retried", above=0.0)
    reward_url_retries: int = _f(3, "retries of a request to task.reward_url that cannot connect, times out or "
                                    "gets HTTP 429/5xx (exponential backoff); then reward_on_error applies",
                                 min=0, max=20)
    reward_url_batch_size: int = _f(64, "samples per request to task.reward_url", min=1)
    tools: list = _f([], "tools the model may call (module:function, type hints and a docstring): multi-turn "
                         "rollouts (docs/agents.md); empty = the task's own tools, if any")
    environment: str = _f("", "module:Class, an engine.agents.environment.Environment subclass driving "
                              "multi-turn rollouts (docs/agents.md); empty = none")
    prompt_key: str = _f("prompt", "column holding the prompt (text, or a list of {role, content} messages)")
    answer_key: str = _f("answer", "column holding the reference answer (verl rows: reward_model.ground_truth)")
    num_train: int = _f(512, "built-in tasks: number of training prompts generated", min=1, max=1_000_000)
    num_val: int = _f(64, "held-out prompts: generated (built-in tasks) or taken from the data (at most)", min=0,
                      max=100_000)
    sort_length: int = _f(4, "task=sort: digits per prompt (its difficulty: 2 is easy, 4 the default)", min=2,
                          max=12)
    chat_template: bool = _f(False, "wrap text prompts in the tokenizer's chat template (message prompts always "
                                    "use it)")
    allow_dataset_change: bool = _f(False, "rl resume: continue although the dataset differs from the one the "
                                           "run started with")


@dataclass
class LoraConfig:
    rank: int = _f(0, "LoRA rank (peft); 0 = off, the whole model trains. FSDP engine only", min=0)
    alpha: float = _f(16.0, "LoRA alpha: the update is scaled by alpha / rank (0 would train nothing)", above=0.0)
    dropout: float = _f(0.0, "dropout on the LoRA input", min=0.0, max=1.0)
    target_modules: list = _f([], "module names to adapt, e.g. [q_proj,v_proj]; empty = peft's default for the architecture (all linear layers if it has none)")


@dataclass
class ModelConfig:
    path: str = _f("", "Hugging Face model: a local directory or a hub id in the local HF cache (offline); empty builds the tiny built-in model")
    preset: str = _f("tiny", "named model preset (see configs/model/)")
    hidden_size: int = _f(64, "tiny model: hidden size", min=8, max=65536)
    intermediate_size: int = _f(128, "tiny model: MLP size", min=8, max=262144)
    num_layers: int = _f(2, "tiny model: transformer layers", min=1, max=1024)
    num_attention_heads: int = _f(4, "tiny model: attention heads", min=1, max=1024)
    num_key_value_heads: int = _f(2, "tiny model: key/value heads (GQA)", min=1, max=1024)
    max_position_embeddings: int = _f(128, "tiny model: longest sequence", min=8, max=1_048_576)
    tie_word_embeddings: bool = _f(False, "tiny model: share input and output embeddings")
    attention_bias: bool = _f(False, "tiny model: q/k/v bias (Qwen2-style)")
    dtype: str = _f("float32", "parameter dtype for training", choices=["float32", "bfloat16"])
    lora: LoraConfig = field(default_factory=LoraConfig, metadata={"help": "LoRA adapters instead of full fine-tuning"})


@dataclass
class OptimConfig:
    lr: float = _f(5e-3, "peak learning rate (AdamW)", above=0.0)
    weight_decay: float = _f(0.0, "AdamW weight decay", min=0.0)
    betas: list = _f([0.9, 0.99], "AdamW betas: two numbers, each in [0, 1)", length=2, item_min=0.0,
                     item_below=1.0)
    eps: float = _f(1e-8, "AdamW epsilon (0 would divide 0 by 0 where a gradient entry is 0)", above=0.0)
    warmup_steps: int = _f(2, "linear warmup over this many optimizer steps", min=0)
    schedule: str = _f("constant", "LR after warmup", choices=["constant", "cosine", "linear"])
    min_lr_ratio: float = _f(0.1, "cosine/linear: final LR as a fraction of the peak", min=0.0, max=1.0)
    grad_clip: float = _f(1.0, "clip the global gradient norm to this; 0 = off", min=0.0)


@dataclass
class AlgorithmConfig:
    name: str = _f("grpo", "advantage estimator (docs/algorithms.md)",
                   choices=["grpo", "dr_grpo", "rloo", "reinforce_pp", "dapo", "ppo"])
    rollout_n: int = _f(8, "samples per prompt (the GRPO group size)", min=1)
    norm_adv_by_std: bool = _f(True, "divide group-centred rewards by the group std (off for Dr. GRPO)",
                               only_for={"algorithm": ("grpo", "dapo")})
    clip_ratio_low: float = _f(0.2, "ppo_clip: the token ratio's lower clip bound is 1 - this", min=0.0)
    clip_ratio_high: float = _f(0.28, "ppo_clip: the token ratio's upper clip bound is 1 + this", min=0.0)
    clip_ratio_c: float = _f(0.0, "ppo_clip: dual-clip (verl's clip_ratio_c, 3 there): a token with a negative "
                                  "advantage adds at most c x |A| to the loss, so one whose ratio is above c adds no "
                                  "gradient (only ratios far from 1 reach it: samples from older weights, several "
                                  "updates per batch); 0 = off, else > 1", min=0.0)
    loss_agg_mode: str = _f("token-mean", "how per-token losses become one scalar",
                            choices=["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
    loss: str = _f("ppo_clip", "policy loss: ppo_clip (a ratio and clip per token) or gspo (one ratio per response, "
                               "the geometric mean of its tokens' ratios, clipped with gspo_clip_ratio_*; "
                               "Zheng et al. 2025); docs/algorithms.md", choices=["ppo_clip", "gspo"])
    gspo_clip_ratio_low: float = _f(3e-4, "gspo: the sequence ratio's lower clip bound is 1 - this (the paper's 3e-4)",
                                    min=0.0)
    gspo_clip_ratio_high: float = _f(4e-4, "gspo: the sequence ratio's upper clip bound is 1 + this (the paper's 4e-4)",
                                     min=0.0)
    kl_coef: float = _f(0.0, "weight of the KL to the frozen reference policy; 0 = no reference", min=0.0)
    kl_type: str = _f("low_var_kl", "KL estimator on sampled tokens (d = log pi - log ref): k1 = d, k2 = d^2/2, "
                                    "k3 = exp(-d) + d - 1, low_var_kl = k3 clamped to [-10, 10] (verl's); as a loss, "
                                    "k2's gradient is that of KL(pi || ref) and k1's is 0 in expectation (refused)",
                      choices=["k1", "k2", "k3", "low_var_kl"])
    use_kl_loss: bool = _f(True, "KL as a loss term (true) or as a per-token reward penalty (false)")
    entropy_coef: float = _f(0.0, "entropy bonus weight", min=0.0)
    ppo_epochs: int = _f(1, "passes over each rollout batch", min=1)
    ppo_mini_batch_size: int = _f(0, "prompts per optimizer step; 0 = the whole batch (one step per RL step)", min=0)
    gamma: float = _f(1.0, "reinforce_pp/ppo: discount of future token rewards", min=0.0, max=1.0,
                      only_for={"algorithm": ("reinforce_pp", "ppo")})
    lam: float = _f(0.95, "ppo: GAE lambda (bias/variance trade-off of the advantage)", min=0.0, max=1.0,
                    only_for={"algorithm": ("ppo",)})
    whiten_advantages: bool = _f(True, "ppo: normalise GAE advantages over the batch's tokens (mean 0, std 1)",
                                 only_for={"algorithm": ("ppo",)})
    dynamic_sampling: bool = _f(False, "drop prompt groups whose rewards are all equal and refill from further "
                                       "prompts, keeping data.train_batch_size groups (DAPO)")
    dynamic_sampling_max_rounds: int = _f(4, "dynamic sampling: extra rollouts per step before topping the "
                                             "batch up with zero-variance groups", min=1)
    overlong_buffer_len: int = _f(0, "DAPO soft overlong penalty: the last N tokens before rollout.max_new_tokens "
                                     "ramp the reward down by up to overlong_penalty_factor; 0 = off", min=0)
    overlong_penalty_factor: float = _f(1.0, "the largest overlong penalty (reached at rollout.max_new_tokens)",
                                        min=0.0)
    rollout_is: str = _f("auto", "importance weight of the trainer's policy against the sampler's on each token "
                                 "(decoupled PPO: the clip ratio is against the trainer's weights at the update, "
                                 "this weight corrects for the weights that sampled): token (per token), sequence "
                                 "(the product over the response), off; each truncated at rollout_is_cap. auto = "
                                 "token with off_policy_ratio=proximal when trainer.mode samples ahead, else off",
                         choices=["auto", "off", "token", "sequence"])
    off_policy_ratio: str = _f("behavior", "what PPO's ratio and clip compare the trained policy with when samples "
                                           "may be stale (trainer.mode one_step_off/async): behavior = the sampler's own "
                                           "log-probs (the clip bounds the policy's move from the weights that "
                                           "sampled; no separate weight); proximal = the trainer's "
                                           "weights at the update, with the rollout importance weight correcting for "
                                           "the sampling weights (decoupled PPO, as verl's rollout_is)",
                               choices=["behavior", "proximal"])
    behavior_clip: str = _f("per_version", "off_policy_ratio=behavior: the clip bounds of a sample s policy "
                                           "versions behind the trained weights; per_version = (1 - clip_ratio_low)^(s+1) "
                                           ".. (1 + clip_ratio_high)^(s+1) (each update since the sampling weights "
                                           "may move the policy by PPO's clip, as the trained one will); fixed = "
                                           "1 -/+ clip_ratio_* whatever the staleness",
                            choices=["per_version", "fixed"])
    rollout_is_cap: float = _f(2.0, "upper truncation of the rollout importance weight (truncated IS; verl's "
                                    "rollout_is_threshold)", above=0.0)
    router_replay: str = _f("off", "mixture-of-experts policies: record the rollout's top-k experts per token and "
                                   "layer (record), and also make the trainer's forward use them (replay); "
                                   "docs/moe.md", choices=["off", "record", "replay"])


@dataclass
class RolloutConfig:
    name: str = _f("torch", "generation backend", choices=["torch", "vllm"])
    temperature: float = _f(1.0, "sampling temperature (> 0: the trainer's log-probs divide by it; validation "
                                 "is greedy whatever it is)", above=0.0)
    top_p: float = _f(1.0, "nucleus sampling mass, in (0, 1] (as vLLM takes it); 1 = off", above=0.0, max=1.0)
    max_new_tokens: int = _f(12, "longest response", min=1)
    micro_batch_size: int = _f(0, "sequences generated together per rank; 0 = all at once", min=0)
    decode_lanes: int = _f(0, "torch rollout: decode the rows as this many lanes of whole prompt groups, each on "
                              "its own thread with one intra-op thread; 0 = auto (the rank's threads on a CPU, "
                              "1 on an accelerator)", min=0, only_for={"rollout": ("torch",)})
    cuda_graphs: bool = _f(False, "torch rollout on a GPU: capture each decode step (forward and sampling) as a "
                                  "CUDA graph per batch-size bucket and replay it (engine/rollout/graphed_decode.py; "
                                  "not yet run on a GPU)", only_for={"rollout": ("torch",)})
    ignore_eos: bool = _f(False, "fixed-length generation: EOS is never sampled, every response has exactly "
                                 "max_new_tokens tokens (benchmarks; like HF min_new_tokens / vLLM min_tokens)")
    gpu_memory_utilization: float = _f(0.4, "vllm: fraction of device memory for weights + KV cache", min=0.0, max=1.0,
                                       only_for={"rollout": ("vllm",)})
    verify_sync: bool = _f(False, "vllm: after each weight sync, check vLLM log-probs equal the trainer's",
                           only_for={"rollout": ("vllm",)})
    max_turns: int = _f(4, "multi-turn (task.tools or task.environment): model turns per trajectory at most",
                        min=1)
    max_trajectory_tokens: int = _f(0, "multi-turn: tokens after the prompt per trajectory at most (model and "
                                       "tool tokens; the trajectory stops there); 0 = max_turns x max_new_tokens",
                                    min=0)
    tool_parser: str = _f("auto", "multi-turn: the tool-call format read from the model's output; auto = hermes "
                                  "for a chat template with <tool_call>, compact for the built-in tokenizer",
                          choices=["auto", "hermes", "compact"])


@dataclass
class EngineConfig:
    """What every training backend understands. Subclasses add parallel layout."""

    name: str = _f("fsdp", "training backend", choices=["fsdp", "megatron"])
    param_offload: bool = _f(False, "offload params to host and release grad buffers while the engine is idle")
    optimizer_offload: bool = _f(False, "offload optimizer state to host while the engine is idle")
    micro_batch_size: int = _f(0, "sequences per forward/backward; 0 = use max_tokens_per_micro_batch", min=0)
    max_tokens_per_micro_batch: int = _f(4096, "token budget per micro-batch (padded tokens counted); 0 = the largest "
                                               "budget whose estimated peak fits engine.micro_batch_memory_fraction "
                                               "of the memory each rank has (a GPU's free memory; on a CPU the host's "
                                               "available memory shared by its ranks), fitted when the ranks start",
                                         min=0)
    micro_batch_memory_fraction: float = _f(0.8, "engine.max_tokens_per_micro_batch=0: the share of the rank's "
                                                 "memory the estimated peak may reach (the rest is margin for what "
                                                 "the estimate does not see: allocator fragmentation, kernels' "
                                                 "workspaces)", above=0.0, max=1.0)
    pad_to_length: bool = _f(False, "pad each micro-batch's length up to a bucket boundary (few shapes)")
    pad_to_length_bucket: int = _f(16, "bucket granularity: every boundary of every policy is a multiple of it (lcm with TP/SP/CP/FP8 alignment)", min=1)
    pad_to_length_policy: str = _f("multiple", "bucket boundaries", choices=["multiple", "geometric", "learned"])
    pad_to_length_max_shapes: int = _f(8, "policy=learned: at most this many distinct lengths", min=1)
    pad_to_length_refresh_steps: int = _f(5, "policy=learned: refit after the first step, then every N steps", min=1)
    gradient_checkpointing: bool = _f(False, "recompute activations in backward")
    activation_offload: bool = _f(False, "move tensors saved for backward by matching modules to host during the update's forward, back (prefetched) for backward")
    activation_offload_modules: list = _f([], "glob patterns over module names whose saved activations are offloaded; empty = every decoder layer")
    activation_offload_host_cache_limit_gb: float = _f(8.0, "host memory per rank for offloaded activations (GiB, reused across micro-batches); beyond it tensors stay on the device and are counted", min=0.0)
    skip_zero_advantage_rows: bool = _f(True, "skip the forward+backward of rows whose advantage is 0 on every "
                                              "token (groups whose samples all scored the same) when the loss has "
                                              "no KL or entropy term: the same gradient, metrics from a no-grad pass")
    logprob_chunk_tokens: int = _f(1024, "log-probs and entropy of the update and the no-grad passes computed this "
                                         "many token positions at a time in fp32 from logits kept in the model's "
                                         "dtype: the fp32 [tokens, vocab] working set is this many rows, whatever "
                                         "the micro-batch (engine/algorithms/logprobs.py)", min=1)
    fused_lm_head: bool = _f(False, "fsdp: the output layer computes the log-probs and entropy itself, in the "
                                    "update and the no-grad (old, reference) passes, engine.logprob_chunk_tokens "
                                    "positions at a time, so the [tokens, vocab] logits and their gradient never "
                                    "exist, in the prompt-shared forward too (Llama/Qwen/Mistral causal LMs; "
                                    "engine/backends/fused_head.py)",
                             only_for={"engine": ("fsdp",)})
    fp8: bool = _f(False, "Transformer-Engine FP8 (needs TE and an FP8-capable GPU)",
                   only_for={"engine": ("megatron",)})
    compile: bool = _f(False, "fsdp: torch.compile each decoder block's forward for the update (generation "
                               "stays eager); pair with engine.pad_to_length for few shapes",
                   only_for={"engine": ("fsdp",)})
    fused_kernels: bool = _f(False, "fsdp: the update's RMSNorm and SiLU-gated MLP activation as fused kernels "
                                    "generated by torch.compile (Llama/Qwen/Mistral layers; the first step compiles)",
                         only_for={"engine": ("fsdp",)})


@dataclass
class FSDPEngineConfig(EngineConfig):
    reshard_after_forward: bool = _f(True, "FSDP2: free gathered params after forward (ZeRO-3) or keep (ZeRO-2)")
    fsdp_unit: str = _f("auto", "what one FSDP2 unit gathers at a time: each decoder layer (bounded gathered "
                                "memory), the whole model (one gather and one gradient reduction a pass, fewer "
                                "hooks; its gathered weights live through the update) or none (no FSDP2: the plain "
                                "model, one rank and float32 only); auto = none on a one-rank CPU run (model for a "
                                "bf16/fp16 model), layer otherwise",
                        choices=["auto", "layer", "model", "none"])
    cpu_matmul: str = _f("auto", "on a CPU: the GEMM library of every linear layer, in the update and the rollout: "
                                 "onednn (picks kernels by the CPU's instructions: 2x MKL's rate on AMD CPUs with "
                                 "AVX-512), aten (torch's default: MKL on x86); auto = onednn on AMD x86 CPUs where this torch has it, aten "
                                 "on Intel ones (MKL's AVX-512 code is faster there) and elsewhere. "
                                 "The same fp32 products, summed in another order",
                         choices=["auto", "onednn", "aten"])


@dataclass
class MegatronEngineConfig(EngineConfig):
    name: str = _f("megatron", "training backend", choices=["fsdp", "megatron"])
    tensor_model_parallel_size: int = _f(1, "tensor-parallel ranks", min=1)
    pipeline_model_parallel_size: int = _f(1, "pipeline-parallel ranks", min=1)
    context_parallel_size: int = _f(1, "context-parallel ranks", min=1)
    sequence_parallel: bool = _f(False, "sequence parallel (forced off when TP = 1)")
    use_distributed_optimizer: bool = _f(True, "shard optimizer state over data-parallel ranks (GPU)")
    expert_model_parallel_size: int = _f(1, "MoE: expert-parallel ranks (the experts of each layer split over them; "
                                            "must divide the data-parallel ranks and the experts)", min=1)
    moe_aux_loss_coef: float = _f(0.0, "MoE: load-balancing loss coefficient, Hugging Face's router_aux_loss_coef "
                                       "(0 = none, as the FSDP engine trains)", min=0.0)
    moe_z_loss_coef: float = _f(0.0, "MoE: router z-loss coefficient (ST-MoE; 0 = none)", min=0.0)


@dataclass
class CriticConfig:
    """The value model of algorithm=ppo (FSDP2: engine/backends/fsdp/critic.py; megatron: engine/backends/megatron/critic.py)."""

    model_path: str = _f("", "model directory for the critic; empty = a copy of the policy's initial network")
    lr: float = _f(1e-2, "critic AdamW learning rate (constant)", above=0.0)
    weight_decay: float = _f(0.0, "critic AdamW weight decay", min=0.0)
    grad_clip: float = _f(1.0, "clip the critic's global gradient norm to this; 0 = off", min=0.0)
    cliprange_value: float = _f(0.5, "value clipping: new values stay within this of the pre-update values",
                                min=0.0)
    warmup_steps: int = _f(0, "RL steps that train only the critic before the policy starts updating", min=0)


@dataclass
class AlarmsConfig:
    """Thresholds of the alarms raised in the step table, metrics.jsonl and the summary
    (engine/algorithms/alarms.py)."""

    entropy_min: float = _f(0.02, "entropy collapse: policy entropy below this ...", min=0.0)
    entropy_steps: int = _f(5, "... for this many steps in a row ...", min=1)
    entropy_reward_max: float = _f(0.9, "... while the mean reward of the last `window` steps is below this",
                                   min=0.0)
    truncated_max: float = _f(0.5, "length blow-up: share of responses cut at rollout.max_new_tokens at least "
                                   "this ...", min=0.0, max=1.0)
    truncated_rise: float = _f(0.25, "... and risen by at least this over its lowest value in the run ...",
                               min=0.0, max=1.0)
    reward_drop: float = _f(0.05, "... while the `window`-step mean reward is this far below its best", min=0.0)
    rollout_kl_max: float = _f(0.05, "log-prob mismatch: approx KL(rollout || trainer) per token above this",
                               min=0.0)
    val_drop: float = _f(0.05, "validation drop: held-out score this far below its best while training "
                               "reward rose", min=0.0)
    no_signal_steps: int = _f(3, "no learning signal: every advantage 0 (each prompt group's samples scored the "
                                 "same) for this many steps in a row", min=1)
    window: int = _f(10, "steps averaged for the training reward the alarms compare", min=1)
    nonfinite_steps: int = _f(3, "non-finite gradient: stop the run after this many steps in a row whose every "
                                 "policy update was skipped for a nan/inf gradient norm", min=1)


@dataclass
class CheckpointConfig:
    dir: str = _f("ckpt", "run directory: config, metrics and step_N/ checkpoints (a leading ~ is your home)",
                  expand_user=True)
    save_freq: int = _f(20, "save every N steps (and at the end); 0 = only at the end", min=0)
    keep_last: int = _f(2, "complete checkpoints to keep; older ones are pruned; 0 = keep all", min=0)
    overwrite: bool = _f(False, "allow a new run to replace an existing run directory (every file of the old run is deleted; files that are not the run's are kept)")
    save_final: bool = _f(True, "save after the last step")


@dataclass
class EvalConfig:
    """`rl eval` (engine/evaluate/): which prompts, how many samples, where the responses go.
    `rl train` does not read these keys."""

    split: str = _f("held-out", "prompts to evaluate on: the task's held-out split (dataset tasks: task.val_split "
                                "if set, else the rows the run held out) or its train split",
                    choices=["held-out", "train"])
    max_prompts: int = _f(0, "evaluate at most this many prompts of the split (its first ones); 0 = all", min=0)
    greedy: bool = _f(True, "a greedy pass: one response per prompt (accuracy and reward)")
    n: int = _f(0, "a sampled pass: this many responses per prompt at eval.temperature (mean accuracy, reward, "
                   "pass@k); 0 = none", min=0)
    k: list = _f([], "pass@k for these k (each at most eval.n), by the unbiased estimator 1 - C(n-c,k)/C(n,k); "
                     "empty = 1, 2, 4, ... up to n, and n", item_min=1)
    temperature: float = _f(1.0, "sampled pass: sampling temperature", above=0.0)
    top_p: float = _f(1.0, "sampled pass: nucleus sampling mass, in (0, 1]; 1 = off", above=0.0, max=1.0)
    seed: int = _f(0, "seeds the sampled pass's draws", min=0, max=2**32 - 1)
    pass_threshold: float = _f(1.0, "tasks without a correctness check: a response counts as correct (accuracy, "
                                    "pass@k) when its reward is at least this")
    output: str = _f("eval.jsonl", "every response with its prompt, reward and data source, one JSON line each "
                                   "(written atomically; an earlier rl eval output is replaced, any other file "
                                   "refused); empty = none", expand_user=True)


@dataclass
class RunConfig:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    engine: EngineConfig = field(default_factory=FSDPEngineConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    critic: CriticConfig = field(default_factory=CriticConfig, metadata={"only_for": {"algorithm": ("ppo",)}})
    alarms: AlarmsConfig = field(default_factory=AlarmsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


ENGINE_CONFIGS: dict[str, type] = {"fsdp": FSDPEngineConfig, "megatron": MegatronEngineConfig}

# Config groups: the YAML files under configs/<group>/ pick one option each; these are the
# options a run gets when it names none (configs/rl.yaml's defaults list is generated from them).
CONFIG_GROUP_DEFAULTS = {"engine": "fsdp", "task": "echo", "model": "tiny", "algorithm": "grpo", "rollout": "torch"}
CONFIG_GROUPS = tuple(CONFIG_GROUP_DEFAULTS)


def nested_section(f) -> Optional[type]:
    """The dataclass behind a field that is itself a section (e.g. ``model.lora``), else None."""
    from dataclasses import MISSING, is_dataclass

    factory = f.default_factory
    return factory if factory is not MISSING and isinstance(factory, type) and is_dataclass(factory) else None


def section_types(engine_name: Optional[str] = None) -> dict[str, type]:
    """The dataclass behind each top-level section, with the engine resolved."""
    from dataclasses import fields

    out = {f.name: f.default_factory for f in fields(RunConfig)}  # type: ignore[misc]
    out["engine"] = ENGINE_CONFIGS.get(engine_name or "fsdp", FSDPEngineConfig)
    return out
