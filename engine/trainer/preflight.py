"""Preflight: everything a run needs, checked before its run directory is created.

    report = preflight(cfg, run_dir=Path(cfg.checkpoint.dir))          # rl train (and --dry-run)
    report = preflight(plan.config, run_dir=Path(plan.run_dir), resume=plan)   # rl resume
    report.raise_if_failed()     # ConfigError (exit 2): one paragraph per failed check
    inputs = report.inputs       # the prepared task/tokenizer/prompts, reused by train()

Checks, in order (a check whose input failed is skipped, never reported twice):
  extras          packages the chosen engine and rollout need (`pip install 'rl[megatron]'`)
  device          trainer.device=cuda needs CUDA, engine.fp8 an FP8-capable GPU
  reward function a prompt-file/dataset task's reward function imports and takes
                  (prompt, response, answer); a built-in task refuses task.reward_fn(s) and
                  task.reward_weights (they would be ignored)
  model and task  the model path/preset resolves, its tokenizer loads, the prompts encode and fit
  run directory   not held by another run, not an existing run (unless overwrite/resume),
                  writable (probed with a temporary directory, removed again), free space for one
                  checkpoint (estimated from the parameter count; on resume, the checkpoint's size)

Values (finite numbers, ranges, list lengths, seed range) and interpolations are checked when
the config is built (engine.config.validate / engine.config.interpolation), before this runs.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from engine.config.schema import RunConfig
from engine.errors import ConfigError, UserError
from engine.trainer.io_errors import describe_os_error


# (config key, value) -> (module to find, distribution, pip extra)
EXTRAS = {
    ("engine", "megatron"): ("megatron.core", "megatron-core", "megatron"),
    ("rollout", "vllm"): ("vllm", "vllm", "vllm"),
}


@dataclass
class Check:
    name: str
    ok: bool | None          # None: skipped (an earlier check it depends on failed)
    detail: str
    title: str = "preflight"

    def to_json(self) -> dict:
        return {"name": self.name, "ok": self.ok, "detail": self.detail}


@dataclass
class PreflightReport:
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    estimated_checkpoint_bytes: int | None = None
    inputs: object = field(default=None, repr=False)   # engine.trainer.setup.RunInputs

    @property
    def ok(self) -> bool:
        return all(c.ok is not False for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.ok is False]

    def to_json(self) -> dict:
        return {"ok": self.ok, "checks": [c.to_json() for c in self.checks], "notes": list(self.notes),
                "estimated_checkpoint_bytes": self.estimated_checkpoint_bytes}

    def close(self) -> None:
        """Release what the prepared inputs hold (the reward runner's process pool, if started)."""
        rewards = getattr(self.inputs, "rewards", None)
        if rewards is not None:
            rewards.close()

    def raise_if_failed(self) -> None:
        bad = self.failures
        if not bad:
            return
        if len(bad) == 1:
            raise ConfigError(bad[0].detail + " Nothing was created.", title=bad[0].title)
        text = " ".join(f"({i}) {c.name}: {c.detail}" for i, c in enumerate(bad, 1))
        raise ConfigError(f"{len(bad)} problems: {text} Nothing was created.", title="preflight failed")


def _record(report: PreflightReport, name: str, fn) -> bool:
    """Run one check: fn() -> detail (ok) or raises UserError (failed)."""
    try:
        detail = fn()
    except UserError as e:
        report.checks.append(Check(name, False, e.message, e.title))
        return False
    report.checks.append(Check(name, True, detail or "ok"))
    return True


def _skip(report: PreflightReport, name: str, why: str) -> None:
    report.checks.append(Check(name, None, f"skipped: {why}"))


# ---- extras ---------------------------------------------------------------------------
def module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package missing, or blocked (sys.modules[name] = None)
        return False


def check_extras(cfg: RunConfig) -> str:
    needed = []
    chosen = {"engine": cfg.engine.name, "rollout": cfg.rollout.name}
    for (key, value), (module, dist, extra) in EXTRAS.items():
        if chosen.get(key) == value:
            if not module_available(module):
                how = "--engine megatron" if key == "engine" else f"{key}={value}"
                raise ConfigError(f"`{how}` needs {dist}, which is not installed (no `{module}` module). Install "
                                  f"it with `pip install 'rl[{extra}]'`, or choose another {key}.",
                                  title="missing dependency")
            needed.append(dist)
    return f"installed: {', '.join(needed)}" if needed else "nothing extra needed"


def _check_device(cfg: RunConfig) -> str:
    from engine.device import check_device_config
    from engine.trainer.ray_cluster import ranks_elsewhere

    if ranks_elsewhere(cfg.trainer.ray_address):  # the ranks check their own machines' hardware
        return f"trainer.device={cfg.trainer.device} (checked on the cluster's machines, not this one)"
    check_device_config(cfg)  # CUDA / FP8 hardware
    return f"trainer.device={cfg.trainer.device}"


# ---- reward function ------------------------------------------------------------------
def check_reward(cfg: RunConfig, resume: bool) -> str:
    """A dataset task's reward functions import and fit their calling convention (checked by
    engine.rewards.spec, which owns the conventions); a built-in task takes none."""
    from engine.config.schema import BUILTIN_TASKS  # they score with their own rule: reward_fn does not apply

    t = cfg.task
    named = [(k, x) for k, x in [("task.reward_fn", t.reward_fn), *(("task.reward_fns", x) for x in t.reward_fns or []),
                                 ("task.correct_fn", t.correct_fn)] if x]
    if t.name in BUILTIN_TASKS:
        if named and not resume:
            key, fn = named[0]
            raise ConfigError(f"`{key}={fn}` does not apply to the built-in task `task={t.name}`, "
                              f"which scores responses with its own rule; it would be silently ignored. Drop "
                              f"it, or train on your own prompts with it (task=dataset task.path=prompts.jsonl "
                              f"task.reward_fn={fn}).", title="invalid config")
        if t.reward_weights and not resume:  # they weight task.reward_fns, which a built-in task has none of
            weights = "[" + ",".join(str(w) for w in t.reward_weights) + "]"
            raise ConfigError(f"`task.reward_weights={weights}` does not apply to the built-in task `task={t.name}`, "
                              f"which scores responses with its one rule (no task.reward_fns to weight); it would be "
                              f"silently ignored. Drop it, or weight your own reward functions on your own prompts "
                              f"(task=dataset task.path=prompts.jsonl 'task.reward_fns=[mod:fmt,mod:acc]' "
                              f"'task.reward_weights={weights}').", title="invalid config")
        return f"built-in rule of task={t.name}"
    from engine.rewards.spec import user_reward_specs

    return ", ".join(s.name for s in user_reward_specs(t)) or "none (the reward scorers score)"


# ---- model and task -------------------------------------------------------------------
def check_model_and_task(cfg: RunConfig, report: PreflightReport) -> str:
    from engine.trainer.setup import prepare_inputs, resolve_critic_path, resolve_model_path

    try:
        model_path = resolve_model_path(cfg)
        report.inputs = prepare_inputs(cfg)
        critic_path = resolve_critic_path(cfg, report.inputs.vocab["size"])
    except UserError:
        raise
    except Exception as e:  # a model directory transformers cannot read, a tokenizer that fails to load
        what = f"model.path={cfg.model.path}" if cfg.model.path else f"model={cfg.model.preset}"
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        raise ConfigError(f"`{what}` cannot be loaded: {type(e).__name__}: {first}. Point model.path at a local "
                          f"Hugging Face model directory (config.json, tokenizer, weights), or drop it to use the "
                          f"tiny built-in model.", title="invalid model") from None
    inputs = report.inputs
    note = pretrained_lr_note(cfg, estimated_params(cfg, inputs))
    if note:
        report.notes.append(note)
    return (f"{model_path or 'tiny built-in model'}; task={cfg.task.name}: {len(inputs.train_prompts)} train / "
            f"{len(inputs.val_prompts)} held-out prompts" + (f"; critic {critic_path}" if critic_path else ""))


# ---- run directory --------------------------------------------------------------------
def estimate_checkpoint_bytes(cfg: RunConfig, resume=None, inputs=None) -> int | None:
    """One checkpoint's size, without importing torch: on resume the checkpoint's own size; else
    params x (param bytes + AdamW's two fp32 moments) plus a margin (RNG, manifest, DCP
    metadata). Params: the tiny model's from its dims; a model directory's from its weight
    files (assumed 16-bit on disk). None when there is nothing to estimate from."""
    if resume is not None:
        try:
            return sum(p.stat().st_size for p in Path(resume.step_dir).rglob("*") if p.is_file())
        except OSError:
            return None
    n = estimated_params(cfg, inputs)
    if n is None:
        return None
    per_param = (2 if cfg.model.dtype == "bfloat16" else 4) + 8
    return int(n * per_param * 1.25) + 256 * 1024


def estimated_params(cfg: RunConfig, inputs) -> int | None:
    """The policy's parameter count without building it: the tiny model's from its dims, a model
    directory's from its safetensors headers (exact), else from its weight files' size (assumed
    16-bit on disk). None when unknown."""
    if inputs is None:
        return None
    model_path = getattr(inputs, "model_path", None)
    if model_path:
        try:
            files = [p for p in Path(model_path).iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".gguf")]
            if files and all(p.suffix == ".safetensors" for p in files):
                from math import prod

                from engine.checkpoint.io.safetensors import read_header

                return sum(prod(int(d) for d in e.get("shape", ())) for p in files
                           for e in read_header(p)[0].values())
            return sum(p.stat().st_size for p in files) // 2
        except (OSError, UserError, TypeError, ValueError, AttributeError):
            return None
    return tiny_param_count(cfg, inputs.vocab["size"])


def pretrained_lr_note(cfg: RunConfig, params: int | None) -> str:
    """A warning when a model of pretrained size trains at the schema's learning rate, which is
    the tiny random-init model's (5e-3): that rate wrecks pretrained weights within a few steps
    (measured on SmolLM2-135M: greedy answers turn to repeated digits after two steps)."""
    from engine.config.schema import OptimConfig

    default = OptimConfig().lr
    if not cfg.model.path or params is None or params < 20_000_000 or cfg.optim.lr != default:
        return ""
    return (f"optim.lr={default} is the tiny built-in model's default; this model has {params / 1e6:,.0f}M "
            f"parameters, and pretrained models are trained with ~1e-6 (verl and TRL's default; rl's SmolLM2 preset "
            f"uses 2e-6). At {default} the weights are wrecked within a few steps: set optim.lr explicitly, e.g. "
            f"optim.lr=1e-6.")


def length_normalised_loss_note(cfg: RunConfig) -> str:
    """A warning for ``loss_agg_mode=seq-mean-token-mean`` when responses end at EOS: each token then
    weighs 1/length of its response, so a short low-reward response (an empty one scores the least
    of its group) pushes EOS down up to max_new_tokens times harder than a long one is pushed, and
    a run can stop ending its responses for good (issue 39, docs/algorithms.md "Learning to stop":
    2 of 6 seeds never stopped, where token-mean stopped in 6 of 6)."""
    if cfg.algorithm.loss_agg_mode != "seq-mean-token-mean" or cfg.rollout.ignore_eos:
        return ""
    return ("algorithm.loss_agg_mode=seq-mean-token-mean weighs each token by 1/length of its response: short, "
            "low-reward responses push EOS down hardest, and runs can stop ending their responses for good (2 of 6 "
            "seeds in docs/algorithms.md, 'Learning to stop'). token-mean, the default, weighs every token the same "
            "(TRL's default loss, DAPO's); seq-mean-token-sum is Dr. GRPO's.")


RANK_BASE_BYTES = 400 * 2**20  # one rank's (and the driver's) host memory before any weight: Python, torch,
# transformers, Ray's worker (measured: 420-550 MiB RSS for a rank of the embedded default job)


def check_host_memory(cfg: RunConfig, inputs, meminfo: str = "/proc/meminfo") -> str:
    """A private local Ray puts every rank on this machine: refuse a rank count whose floor of
    host memory (each rank's base, plus its share of the weights, gradients and AdamW moments in
    fp32) is above what the machine has available, before it swaps or the OOM killer picks a
    rank. A joined cluster's nodes are not checked from here."""
    from engine.trainer.ray_cluster import resolve_address

    if not resolve_address(cfg.trainer.ray_address).local:
        return "ranks on the cluster's nodes: not checked here"
    from engine.env_info import host_available_bytes

    avail = host_available_bytes(meminfo)
    if avail is None:
        return "available memory unknown: not checked"
    n = cfg.trainer.nprocs
    params = estimated_params(cfg, inputs) or 0
    need = (n + 1) * RANK_BASE_BYTES + params * 16  # sharded over the ranks: the whole model's 16 B/param once
    if need > avail:
        fit = max(1, (avail - params * 16) // RANK_BASE_BYTES - 1)
        raise ConfigError(
            f"`trainer.nprocs={n}` puts {n} ranks on this machine (a private local Ray), which need at least "
            f"{_fmt_bytes(need)} of host memory ({n} ranks and the driver at ~{_fmt_bytes(RANK_BASE_BYTES)} each, "
            f"plus {_fmt_bytes(params * 16)} for the weights, gradients and AdamW state); {_fmt_bytes(avail)} is "
            f"available. Lower trainer.nprocs (at most ~{fit} fit here), or join a Ray cluster with more nodes "
            f"(trainer.ray_address).", title="not enough memory")
    return f"{n} rank(s) need at least {_fmt_bytes(need)}; {_fmt_bytes(avail)} available"


def tiny_param_count(cfg: RunConfig, vocab: int) -> int:
    """Parameters of the built-in Llama-style model (engine/model/build.py) from model.* dims."""
    m = cfg.model
    h, i, heads, kv = m.hidden_size, m.intermediate_size, m.num_attention_heads, m.num_key_value_heads
    d = h // heads
    bias = 1 if m.attention_bias else 0
    attn = h * heads * d + 2 * h * kv * d + heads * d * h + bias * (heads * d + 2 * kv * d)
    layer = attn + 3 * h * i + 2 * h
    return vocab * h * (1 if m.tie_word_embeddings else 2) + m.num_layers * layer + h


def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists() and p.parent != p:
        p = p.parent
    return p


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def probe_writable(run_dir: Path) -> Path:
    """Create and remove a temporary directory (with a small file) where the run directory
    will be; returns the directory probed. Raises ConfigError naming what is wrong."""
    shown = f"checkpoint.dir={run_dir}"
    from engine.user_paths import stat_path

    # a symlink loop or a too-long name: refused here (exists() is False for both, so the probe
    # below would test the parent and pass); a dangling link: mkdir(exist_ok=True) would fail on it
    if stat_path(run_dir, f"`{shown}`", error=ConfigError, title="run directory unusable") is None \
            and os.path.islink(run_dir):
        raise ConfigError(f"`{shown}` is a symbolic link to {os.readlink(run_dir)}, which does not exist. Create "
                          "that directory first, or choose another checkpoint.dir.", title="run directory unusable")
    try:
        base = _nearest_existing(run_dir.absolute())
        if not base.is_dir():
            where = "is a file" if base == run_dir.absolute() else f"is under {base}, which is a file"
            raise ConfigError(f"`{shown}` {where}, not a directory. Choose another checkpoint.dir.",
                              title="run directory unusable")
        probe = Path(tempfile.mkdtemp(prefix=".rl-preflight-", dir=base))
        try:
            (probe / "probe").write_bytes(b"\0" * 4096)
        finally:
            shutil.rmtree(probe, ignore_errors=True)
    except ConfigError:
        raise
    except (OSError, ValueError) as e:
        raise ConfigError(f"`{shown}` cannot be written: {describe_os_error(e)}. Choose a writable "
                          f"checkpoint.dir.", title="run directory unusable") from None
    return base


def check_run_dir(cfg: RunConfig, run_dir: Path, report: PreflightReport, resume=None) -> str:
    from engine.trainer.run_dir import RunDir
    from engine.trainer.run_lock import RunLock

    holder = RunLock.held_by_other(run_dir)
    if holder is not None:
        raise ConfigError(RunLock.locked_message(run_dir, holder), title="run directory locked")
    from engine.user_paths import refuse_special_run_files

    refuse_special_run_files(run_dir, error=ConfigError)  # a symlinked metrics.jsonl: rows appended wherever it points
    if resume is None:
        problem, note = RunDir(run_dir).existing_run_problem(cfg.checkpoint.overwrite)
        if problem:
            raise UserError(problem, title="run directory in use")
        if note:
            report.notes.append(note)
    base = probe_writable(run_dir)
    need = report.estimated_checkpoint_bytes = estimate_checkpoint_bytes(cfg, resume, report.inputs)
    free = shutil.disk_usage(base).free
    if need is not None and free < need:
        raise ConfigError(f"`checkpoint.dir={run_dir}` has {_fmt_bytes(free)} free; one checkpoint needs about "
                          f"{_fmt_bytes(need)}. Free space there, or choose another checkpoint.dir.",
                          title="not enough disk space")
    est = f"one checkpoint ~{_fmt_bytes(need)}" if need is not None else "checkpoint size not estimated"
    return f"writable, {_fmt_bytes(free)} free ({est})"


# ---- the whole preflight ----------------------------------------------------------------
def preflight(cfg: RunConfig, *, run_dir: Path | None = None, resume=None,
              env_refs: dict | None = None) -> PreflightReport:
    """Check everything the run needs; creates nothing (the writability probe removes itself)."""
    report = PreflightReport()
    run_dir = Path(run_dir if run_dir is not None else cfg.checkpoint.dir)
    if env_refs:
        report.notes.append(f"{len(env_refs)} value(s) read from the environment ({', '.join(sorted(env_refs))}): "
                            f"saved as written (e.g. ${{oc.env:NAME}}), never resolved.")
    loss_note = length_normalised_loss_note(cfg)
    if loss_note:
        report.notes.append(loss_note)
    extras_ok = _record(report, "extras", lambda: check_extras(cfg))
    _record(report, "device", lambda: _check_device(cfg))
    reward_ok = _record(report, "reward function", lambda: check_reward(cfg, resume is not None))
    if cfg.task.reward_model.path or cfg.task.reward_url:  # a reward model, a remote scorer
        from engine.reward_model.build import check_scorers

        reward_ok = _record(report, "reward scorers", lambda: check_scorers(cfg)) and reward_ok
    if extras_ok and reward_ok:
        if _record(report, "model and task", lambda: check_model_and_task(cfg, report)):
            _record(report, "host memory", lambda: check_host_memory(cfg, report.inputs))
        else:
            _skip(report, "host memory", "fix the problems above first")
    else:
        _skip(report, "model and task", "fix the problems above first")
        _skip(report, "host memory", "fix the problems above first")
    _record(report, "run directory", lambda: check_run_dir(cfg, run_dir, report, resume))
    return report
