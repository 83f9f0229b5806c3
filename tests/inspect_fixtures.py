"""Checkpoint builders for tests/test_inspect_ckpt.py, using the real writers.

Every checkpoint here is written by the library that writes it in real life:
torch.distributed.checkpoint.save, torch.save, safetensors.torch.save_file (+ the HF hub's
shard planner for the index), FSDP2 + torch.save in verl's file layout, megatron-core's
dist_checkpointing.save. `rl` run roots are assembled per docs/checkpoint-format.md around
a real DCP save (the same calls engine/checkpoint makes).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Optional

import numpy as np
import torch

# ----------------------------------------------------------------------------------------
# plain writers


def save_dcp(path: Path, state: dict) -> Path:
    """A torch.distributed.checkpoint directory (single process, no process group)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path))
    return path


def rng_state() -> dict:
    """What an rl rank saves in rng/rank_R.pt (docs/checkpoint-format.md)."""
    return {"torch": torch.get_rng_state(), "cuda": None, "python": random.getstate(),
            "numpy": np.random.get_state(), "sampler": None}


# ----------------------------------------------------------------------------------------
# rl run roots


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2))


def make_rl_run(root: Path, config: Optional[dict] = None) -> Path:
    """A run root's run-level files: run.json, config.yaml, versions.json."""
    import yaml

    root.mkdir(parents=True, exist_ok=True)
    _write_json(root / "run.json", {"format": "rl-run", "version": 1,
                                    "created": "2026-11-30T06:00:00Z", "engine": "fsdp"})
    (root / "config.yaml").write_text(yaml.safe_dump(config or {"trainer": {"total_steps": 40}}))
    (root / "overrides.yaml").write_text("- trainer.total_steps=40\n")
    _write_json(root / "versions.json", {"python": "3.11.7", "torch": torch.__version__})
    (root / "metrics.jsonl").write_text('{"step": 1}\n')
    return root


def make_rl_step(root: Path, step: int, params: dict[str, torch.Tensor], *,
                 with_state: Optional[set[str]] = None,
                 legit_missing: frozenset[str] = frozenset(),
                 orphans: tuple[str, ...] = (),
                 frozen: tuple[str, ...] = (),
                 manifest: bool = True, name: Optional[str] = None,
                 config: Optional[dict] = None, world_size: int = 1) -> Path:
    """One rl checkpoint directory.

    ``params``: fqn -> tensor (saved as ``model.<fqn>``). ``with_state``: fqns given AdamW
    state (default all, minus ``frozen``); ``legit_missing``: fqns the manifest marks
    ``param_state: false``; ``orphans``: fqns with optimizer state but no parameter;
    ``frozen``: parameters not trainable (absent from param_state).
    """
    d = root / (name or f"step_{step}")
    (d / "rng").mkdir(parents=True)
    trainable = [f for f in params if f not in frozen]
    with_state = set(trainable) if with_state is None else with_state
    optim: dict = {}
    for fqn in sorted(with_state | set(orphans)):
        t = params.get(fqn, torch.zeros(2))
        optim[f"state.{fqn}.exp_avg"] = torch.zeros_like(t)
        optim[f"state.{fqn}.exp_avg_sq"] = torch.zeros_like(t)
        optim[f"state.{fqn}.step"] = torch.tensor(float(step))
    for fqn in trainable + list(orphans):
        optim[f"param_groups.{fqn}.lr"] = 1e-3
        optim[f"param_groups.{fqn}.betas"] = (0.9, 0.999)
        optim[f"param_groups.{fqn}.weight_decay"] = 0.0
    save_dcp(d / "state", {"model": dict(params), "optim": optim})
    for r in range(world_size):
        torch.save(rng_state(), d / "rng" / f"rank_{r}.pt")
    _write_json(d / "trainer.json", {
        "step": step, "samples_seen": step * 16,
        "data": {"epoch": 0, "index": step * 16, "order_seed": 0},
        "lr_scheduler": {"last_epoch": step, "base_lrs": [1e-3], "_last_lr": [1e-3]},
        "learned_buckets": [64, 128]})
    if manifest:
        files = {str(p.relative_to(d)): p.stat().st_size
                 for p in sorted(d.rglob("*")) if p.is_file()}
        param_state = {f: (f in with_state) and f not in legit_missing for f in trainable}
        for f in legit_missing:
            param_state[f] = False
        _write_json(d / "manifest.json", {
            "format": "rl-checkpoint", "version": 1, "step": step,
            "samples_seen": step * 16, "created": "2026-11-30T06:00:00Z",
            "world_size": world_size, "engine": "fsdp",
            "parallel": {"dp": world_size, "tp": 1, "pp": 1, "cp": 1},
            "model": {"preset": "tiny", "path": "",
                      "num_params": sum(t.numel() for t in params.values()),
                      "params": {f: {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
                                 for f, t in params.items()}},
            "optimizer": {"type": "AdamW", "flattened": True, "param_state": param_state},
            "files": files,
            "config": config or {"trainer": {"total_steps": 40, "seed": 0},
                                 "model": {"preset": "tiny"}},
            "versions": {"torch": torch.__version__, "python": "3.11.7"},
        })
    return d


def tiny_params(hidden: int = 8, vocab: int = 16, layers: int = 2) -> dict[str, torch.Tensor]:
    p = {"embed_tokens.weight": torch.randn(vocab, hidden)}
    for i in range(layers):
        p[f"layers.{i}.mlp.weight"] = torch.randn(hidden, hidden)
        p[f"layers.{i}.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    p["lm_head.weight"] = torch.randn(vocab, hidden)
    return p


# ----------------------------------------------------------------------------------------
# Hugging Face safetensors


def save_hf_sharded(d: Path, state: dict[str, torch.Tensor], max_shard_size: int) -> Path:
    """A sharded HF directory: shards + model.safetensors.index.json, as save_pretrained
    lays them out (shard plan from huggingface_hub), plus a config.json."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: state[n].contiguous() for n in names}, str(d / filename),
                  metadata={"format": "pt"})
    if split.is_sharded:
        _write_json(d / "model.safetensors.index.json",
                    {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                     "weight_map": split.tensor_to_filename})
    _write_json(d / "config.json", {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                    "transformers_version": "4.57.0", "torch_dtype": "float32"})
    return d


# ----------------------------------------------------------------------------------------
# process group (verl FSDP2, megatron-core)


def init_single_process_group(tmp: Path) -> bool:
    """A gloo world of 1 on a FileStore; returns True if this call created it."""
    import torch.distributed as dist

    if dist.is_initialized():
        assert dist.get_world_size() == 1
        return False
    store = dist.FileStore(str(tmp / "pg_store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return True


def save_verl_fsdp(root: Path, step: int) -> Path:
    """verl's FSDP checkpoint layout, written as FSDPCheckpointManager.save_checkpoint does:
    FSDP2 sharded model/optimizer state dicts and extra state via torch.save per rank."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ws, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (ws,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    sched.step()
    actor = root / f"global_step_{step}" / "actor"
    actor.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save(model.state_dict(), actor / f"model_world_size_{ws}_rank_{rank}.pt")
        torch.save(opt.state_dict(), actor / f"optim_world_size_{ws}_rank_{rank}.pt")
        torch.save({"lr_scheduler": sched.state_dict(),
                    "rng": {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(),
                            "random": random.getstate()}},
                   actor / f"extra_state_world_size_{ws}_rank_{rank}.pt")
    _write_json(actor / "fsdp_config.json", {"FSDP_version": 2, "world_size": ws})
    (actor / "huggingface").mkdir()
    _write_json(actor / "huggingface" / "config.json",
                {"model_type": "toy", "transformers_version": "4.57.0"})
    (root / "latest_checkpointed_iteration.txt").write_text(str(step))
    return root / f"global_step_{step}"


def save_megatron_dist(d: Path) -> Path:
    """A megatron-core dist_checkpointing directory (torch_dist backend), written by
    ``megatron.core.dist_checkpointing.save`` in the current (world-of-1) process group.

    megatron-core 0.16.1 calls ``torch.cuda.synchronize()`` after staging tensors to the
    host and builds its failure flag with ``device=torch.cuda.current_device()``; on a
    CPU-only torch both raise. During the save only, they become a no-op and "cpu" (there
    is nothing to synchronize, and gloo broadcasts CPU tensors). The writer itself is
    megatron-core's, unchanged.
    """
    import argparse

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    d.mkdir(parents=True)
    w = torch.randn(8, 16)
    state = {
        "decoder.layers.0.mlp.linear_fc1.weight":
            ShardedTensor.from_rank_offsets("decoder.layers.0.mlp.linear_fc1.weight", w, replica_id=0),
        "embedding.word_embeddings.weight":
            ShardedTensor.from_rank_offsets("embedding.word_embeddings.weight",
                                            torch.randn(32, 16).to(torch.bfloat16), (0, 0, 1)),
        "optimizer": {
            "state": {"exp_avg": ShardedTensor.from_rank_offsets(
                "optimizer.state.exp_avg.decoder.layers.0.mlp.linear_fc1.weight", torch.zeros_like(w))},
            "param_groups": [{"lr": 1e-4, "weight_decay": 0.1}]},
        "rng_state": ShardedObject("rng_state", {"random_rng_state": (1, 2)}, (1,), (0,), replica_id=0),
        "iteration": 30,
        "checkpoint_version": 3.0,
        "args": argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                   world_size=1, hidden_size=16, params_dtype="bf16"),
    }
    sync, current = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    try:
        dist_checkpointing.save(state, str(d))
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = sync, current
    return d


# ----------------------------------------------------------------------------------------
# hostile and damaged inputs


class RunsShellCommand:
    """Pickles as ``os.system(<command>)``: loading it with pickle runs the command."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def truncate(path: Path, keep_fraction: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep_fraction)])
