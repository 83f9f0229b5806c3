"""Memory: estimate vs measured, offload bookkeeping, FP8 workspace clearing, reports.

Everything runs on CPU with real torch, transformers, gloo (FSDP2 / DDP) and megatron-core.
The "device" in the offload tests is the CPU itself (``simulate_on_cpu=True`` runs the real
move logic with separate host buffers), so what moved, what was freed and the bit-exact round
trip are checked without a GPU; bench/gpu_check.sh does the same on a real device with TE.
"""

from __future__ import annotations

import json
import math
import mmap
import multiprocessing as mp
import socket
import warnings
from dataclasses import asdict

import pytest
import torch

from engine.algorithms.logprobs import token_log_probs
import torch.nn.functional as F

from engine.config.schema import MegatronEngineConfig, ModelConfig, RunConfig
from engine.memory.estimate import BUILTIN_MODELS, estimate_memory, parse_bytes
from engine.memory.fp8_workspaces import clear_fp8_workspaces, fp8_workspace_bytes
from engine.memory.offload import (CPU_NOOP_NOTE, host_memory_held, offload_optimizer_state, offload_params,
                                   onload_optimizer_state, onload_params)
from engine.memory.report import CATEGORIES, build_report, load_records, save_records
from engine.memory.tracker import MemoryTracker

VOCAB = 40


# ---- helpers ------------------------------------------------------------------------------
def _tiny_model(seed: int = 0, **overrides):
    from engine.model.build import build_hf_model

    model = build_hf_model(ModelConfig(**overrides), "", vocab_size=VOCAB, seed=seed)
    model.config.use_cache = False
    return model


def _rollout_like_batch(n: int = 128, t: int = 30, seed: int = 0):
    """n right-padded sequences of at most t tokens (the default job: 16 prompts x 8 samples)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (n, t), generator=g)
    lens = torch.randint(t // 2, t + 1, (n,), generator=g)
    lens[0] = t
    mask = (torch.arange(t)[None] < lens[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask


def _train_step(model, opt, tracker, ids, mask):
    """One micro-batch policy-gradient-style step, measured the way the engine measures it."""
    with tracker.activations():
        out = model(input_ids=ids, attention_mask=mask, use_cache=False)
    with tracker.saved_tensors("logits") as m:
        m.add(out.logits)
        tok, _ = token_log_probs(out.logits, ids)
    loss = -(tok * mask).sum() / mask[:, 1:].sum()
    loss.backward()
    tracker.sample_state()
    opt.step()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def gloo_world_of_one():
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()


# ---- modules following Transformer-Engine's _fp8_workspaces contract ------------------------
class QuantizedWeight:
    """What TE stores per workspace entry: FP8 data, its transpose (for wgrad) and a scale."""

    def __init__(self, weight: torch.Tensor):
        w = weight.detach()
        scale = w.abs().amax().clamp(min=1e-12) / 448.0
        self._data = (w / scale).to(torch.float8_e4m3fn)
        self._transpose = self._data.t().contiguous()
        self._scale_inv = scale.reshape(1).float()

    def dequantize(self, dtype) -> torch.Tensor:
        return self._data.to(dtype) * self._scale_inv.to(dtype)

    def nbytes(self) -> int:
        return self._data.numel() + self._transpose.numel() + 4


class FP8WorkspaceLinear(torch.nn.Linear):
    """Imitates Transformer Engine (not installable without CUDA; the real thing runs in
    tests/test_gpu.py): builds ``_fp8_workspaces["weight"]`` lazily on forward (as TE's Linear does) and computes
    with the quantised weight (straight-through gradient to the real weight)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self._fp8_workspaces: dict = {}

    def forward(self, x):
        ws = self._fp8_workspaces.get("weight")
        if ws is None:
            ws = self._fp8_workspaces["weight"] = QuantizedWeight(self.weight)
        w = self.weight + (ws.dequantize(self.weight.dtype) - self.weight).detach()
        return F.linear(x, w, self.bias)


class FP8WorkspaceGroupedLinear(torch.nn.Module):
    """Like TE's GroupedLinear: weights ``weight0..N-1``, workspaces keyed the same way."""

    def __init__(self, n: int, d_in: int, d_out: int):
        super().__init__()
        self.n = n
        for i in range(n):
            setattr(self, f"weight{i}", torch.nn.Parameter(torch.randn(d_out, d_in) * 0.1))
        self._fp8_workspaces: dict = {}

    def forward(self, x):
        outs = []
        for i, chunk in enumerate(x.chunk(self.n, dim=0)):
            w = getattr(self, f"weight{i}")
            ws = self._fp8_workspaces.get(f"weight{i}")
            if ws is None:
                ws = self._fp8_workspaces[f"weight{i}"] = QuantizedWeight(w)
            outs.append(F.linear(chunk, w + (ws.dequantize(w.dtype) - w).detach()))
        return torch.cat(outs, 0)


class FP8Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = FP8WorkspaceLinear(16, 32)
        self.experts = FP8WorkspaceGroupedLinear(2, 32, 32)
        self.fc2 = FP8WorkspaceLinear(32, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.experts(torch.relu(self.fc1(x)))))


def _expected_workspace_bytes() -> int:
    # fc1 [32,16], experts 2 x [32,32], fc2 [8,32]: FP8 data + transpose (1 B each) + fp32 scale
    return sum(2 * n + 4 for n in (32 * 16, 32 * 32, 32 * 32, 8 * 32))


# ---- estimate vs measured -----------------------------------------------------------------
def test_estimate_matches_measured_on_the_default_cpu_job():
    """The estimator's per-category bytes agree with what the tracker measures on a real
    forward/backward/AdamW step of the tiny default model (16x8 sequences of ~30 tokens):
    params, grads, optimizer within 10%, activations (saved-tensor hooks) within 25%."""
    torch.manual_seed(0)
    model = _tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, mask = _rollout_like_batch(128, 30)
    tracker = MemoryTracker("cpu", models={"policy": model}, optimizer=opt)
    with tracker.phase("update", step=1):
        _train_step(model, opt, tracker, ids, mask)
    from engine.config.schema import DataConfig

    est = estimate_memory(RunConfig(data=DataConfig(train_batch_size=16)), vocab_size=VOCAB, seq_len=30)
    assert est.assumptions["micro_batch_sequences"] == 128 and est.assumptions["micro_batch_tokens"] == 128 * 30

    report = build_report("test", est, tracker.phase_records())
    rows = {r.category: r for r in report.comparison if r.phase == "update"}
    n_params = sum(p.numel() for p in model.parameters())
    assert est.param_count == n_params
    for cat, tol in (("params", 10), ("grads", 10), ("optimizer", 10), ("activations", 25), ("logits", 25)):
        r = rows[cat]
        assert r.measured and r.estimate, cat
        assert abs(r.diff_pct) <= tol, f"{cat}: estimate {r.estimate} vs measured {r.measured} ({r.diff_pct}%)"
    rec = tracker.phase_records()[0]
    assert rec.categories["params"] == n_params * 4 and rec.categories["grads"] == n_params * 4
    assert rec.peak_rss >= rec.categories["activations"] // 2 and rec.rss > 0
    assert rec.allocated is None                       # no CUDA figures on CPU


def test_activation_formula_tracks_other_shapes_dtypes_and_attention():
    """The activation formula is structural (per layer), not fitted to one model: it agrees
    with saved-tensor hooks for other dims, bf16, and eager attention."""
    from engine.memory.estimate import _dims_from_hf_config, hf_llama_activation_bytes

    for dtype, attn in (("bfloat16", "sdpa"), ("float32", "eager")):
        model = _tiny_model(hidden_size=96, intermediate_size=160, num_layers=3, num_attention_heads=6,
                            num_key_value_heads=2, dtype=dtype)
        model.config._attn_implementation = attn
        ids, mask = _rollout_like_batch(12, 24)
        tracker = MemoryTracker("cpu", models=model)
        with tracker.phase("update"):
            with tracker.activations() as meter:
                model(input_ids=ids, attention_mask=mask, use_cache=False)
        est = hf_llama_activation_bytes(_dims_from_hf_config(model.config, "x"), seqs=12, seq_len=24,
                                        dtype_bytes=2 if dtype == "bfloat16" else 4, attn_implementation=attn)
        assert abs(meter.bytes - est["total"]) / est["total"] < 0.10, (dtype, attn, meter.bytes, est["total"])
        assert tracker.phase_records()[0].categories["activations"] == meter.bytes


# ---- tracker ------------------------------------------------------------------------------
def test_tracker_resets_peak_per_phase_and_validates_names():
    """Each phase's peak RSS is its own (a large transient in one phase does not leak into
    the next), records are JSON-able, and unknown or nested phases are refused."""
    tracker = MemoryTracker("cpu")
    with tracker.phase("rollout", step=3):
        # 64 MiB of fresh pages, touched: an anonymous mapping, so the process's resident memory
        # grows whatever the allocator holds free from earlier tests (late in one suite run, RSS
        # did not move for a torch tensor of this size)
        big = mmap.mmap(-1, 64 << 20)
        big.write(b"\1" * (64 << 20))
        big.close()
    with tracker.phase("update"):
        tracker.record_bytes("kv_cache", 1234)
    a, b = tracker.phase_records()
    assert a.step == 3 and b.step == 3 and a.phase == "rollout"
    assert a.peak_rss - b.peak_rss > 32 << 20, (a.peak_rss, b.peak_rss)
    assert b.categories["kv_cache"] == 1234
    json.loads(json.dumps(tracker.records(), allow_nan=False))
    with pytest.raises(ValueError, match="unknown memory phase"):
        with tracker.phase("train"):
            pass
    with pytest.raises(RuntimeError, match="inside phase"):
        with tracker.phase("update"):
            with tracker.phase("offload"):
                pass


def test_keyed_saved_tensor_measurement_is_reused_without_hooks():
    """saved_tensors(category, key): the first block with a key is measured through the hooks;
    a later block with the same key records the same bytes without them (yields None, no pack
    hook runs); another key, or no key, is measured again."""
    w = torch.randn(64, 64, requires_grad=True)
    packs = []

    def forward(x):
        return torch.tanh(x @ w).sum()

    tracker = MemoryTracker("cpu")
    with tracker.phase("update"):
        with tracker.saved_tensors("activations", key=("a", 32)) as m:
            forward(torch.randn(32, 64))
        first = m.bytes
    with tracker.phase("update"):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packs.append(1) or t, lambda t: t):
            with tracker.saved_tensors("activations", key=("a", 32)) as m2:
                forward(torch.randn(32, 64))
        reused = tracker._current["categories"]["activations"]
    with tracker.phase("update"):
        with tracker.saved_tensors("activations", key=("a", 128)) as m3:
            forward(torch.randn(128, 64))
    assert first > 0 and m2 is None and reused == first
    assert packs  # the outer hooks saw the forward: the keyed block added none of its own
    assert m3 is not None and m3.bytes > first
    recs = tracker.phase_records()
    assert recs[1].categories["activations"] == first and recs[2].categories["activations"] == m3.bytes


def test_the_meter_lets_go_of_what_it_counted_when_its_block_ends():
    """The meter holds each counted tensor while its block runs (so no address is reused and
    counted twice) and not after: held on, every activation it counted stayed alive through backward
    after autograd had used it (the engines keep the meter with activation offload)."""
    import gc
    import weakref

    w = torch.randn(64, 64, requires_grad=True)
    tracker = MemoryTracker("cpu")
    with tracker.phase("update"):
        with tracker.saved_tensors("activations") as m:
            h = torch.tanh(torch.randn(32, 64) @ w)
            loss = h.sum()
        ref = weakref.ref(h)
        del h
        loss.backward()  # autograd used tanh's saved output and let it go
        del loss
    gc.collect()
    assert m.bytes > 0 and ref() is None, "the meter still held a tensor backward had finished with"


# ---- offload bookkeeping ------------------------------------------------------------------
def _storage_nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def test_offload_round_trip_is_bit_exact_and_reports_what_moved():
    """Params and optimizer state go to host buffers (device storage freed: 0 bytes), grads
    are released, the reports and host accounting say exactly how much, onload restores
    bit-exactly, a second offload reuses the same host buffers, and training continues."""
    torch.manual_seed(0)
    model = _tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, mask = _rollout_like_batch(16, 20)
    tracker = MemoryTracker("cpu", models=model, optimizer=opt)
    with tracker.phase("update"):
        _train_step(model, opt, tracker, ids, mask)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {(n, k): v.clone() for n, p in model.named_parameters() for k, v in opt.state[p].items()}
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    state_bytes = sum(v.numel() * v.element_size() for v in state.values())

    with tracker.phase("offload"):
        rp = offload_params(model, simulate_on_cpu=True)
        ro = offload_optimizer_state(opt, simulate_on_cpu=True)
        tracker.record_offload(rp)
    assert rp.param_bytes == param_bytes and rp.grad_bytes_released == grad_bytes
    assert ro.optimizer_bytes == state_bytes and rp.optimizer_bytes == 0 and ro.param_bytes == 0
    assert "cpu -> host" in rp.note and "0 host buffers reused" in rp.note
    assert all(_storage_nbytes(p) == 0 and p.grad is None for p in model.parameters())
    assert all(_storage_nbytes(v) == 0 for p in model.parameters() for v in opt.state[p].values())
    held = host_memory_held()
    assert held["params"]["offloaded"] >= param_bytes and held["optimizer"]["offloaded"] >= state_bytes
    rec = tracker.phase_records()[-1]
    assert rec.offload == asdict(rp) and rec.host_offload["params"]["offloaded"] >= param_bytes
    assert tracker.state_bytes()["params"] == 0 and tracker.state_bytes()["optimizer"] == 0

    back_p, back_o = onload_params(model, "cpu"), onload_optimizer_state(opt, "cpu")
    assert back_p.param_bytes == param_bytes and back_o.optimizer_bytes == state_bytes
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), params[n]), n
        for k, v in opt.state[p].items():
            assert torch.equal(v, state[(n, k)]), (n, k)

    buffers_before = host_memory_held()["params"]["buffers"]
    again = offload_params(model, simulate_on_cpu=True)
    n_storages = len({p.untyped_storage().data_ptr() for p in params.values()})
    assert f"({n_storages} host buffers reused)" in again.note, again.note
    assert again.grad_bytes_released == 0              # already released
    assert host_memory_held()["params"]["buffers"] == buffers_before
    onload_params(model, "cpu")
    _train_step(model, opt, MemoryTracker("cpu"), ids, mask)     # still trains after the round trip
    assert all(p.grad is not None for p in model.parameters())


def test_offload_is_a_noop_with_a_note_on_cpu_but_still_clears_te_imitating_fp8_workspaces():
    """On a CPU-only run nothing moves and the report says why, but FP8 workspaces are still
    cleared and counted."""
    net = FP8Net()
    net(torch.randn(4, 16)).sum().backward()
    r = offload_params(net)
    assert r.note.startswith(CPU_NOOP_NOTE)
    assert r.param_bytes == 0 and r.grad_bytes_released == 0
    assert (r.fp8_workspaces_cleared, r.fp8_workspace_bytes_freed) == (4, _expected_workspace_bytes())
    assert all(_storage_nbytes(p) > 0 and p.grad is not None for p in net.parameters())
    opt = torch.optim.AdamW(net.parameters())
    opt.step()
    ro = offload_optimizer_state(opt)
    assert ro.optimizer_bytes == 0 and "no-op on CPU" in ro.note
    assert onload_params(net, "cpu").note.startswith(CPU_NOOP_NOTE)


# ---- FP8 workspaces through wrappers ------------------------------------------------------
def test_te_imitating_fp8_workspaces_cleared_through_fsdp2_and_ddp_and_rebuilt(gloo_world_of_one):
    """Inside an FSDP2 (fully_shard) model the TE-contract workspaces (weight, weight0..N) are
    found, counted (entries, bytes) and cleared by parameter offload; the next forward
    rebuilds them and gives the same output. Same through DDP and a list of model chunks."""
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    net = FP8Net()
    for m in (net.fc1, net.experts, net.fc2):
        fully_shard(m)
    fully_shard(net)
    assert isinstance(net, FSDPModule) and all(isinstance(p, DTensor) for p in net.parameters())
    x = torch.randn(6, 16)
    assert fp8_workspace_bytes(net) == (0, 0)
    y0 = net(x)
    y0.sum().backward()
    expected = (4, _expected_workspace_bytes())
    assert fp8_workspace_bytes(net) == expected
    assert set(net.experts._fp8_workspaces) == {"weight0", "weight1"}

    report = offload_params(net, simulate_on_cpu=True)         # the full offload path
    assert (report.fp8_workspaces_cleared, report.fp8_workspace_bytes_freed) == expected
    assert "FP8 workspaces cleared: 4" in report.note
    assert report.param_bytes == sum(p.to_local().numel() * 4 for p in net.parameters())
    assert all(not m._fp8_workspaces for m in (net.fc1, net.experts, net.fc2))
    onload_params(net, "cpu")
    y1 = net(x)
    assert torch.equal(y0, y1) and fp8_workspace_bytes(net) == expected    # rebuilt lazily

    ddp = torch.nn.parallel.DistributedDataParallel(FP8Net())
    ddp(x)
    assert clear_fp8_workspaces(ddp) == expected and fp8_workspace_bytes(ddp) == (0, 0)
    chunks = [FP8Net(), FP8Net()]
    for c in chunks:
        c(x)
    assert clear_fp8_workspaces(chunks) == (8, 2 * expected[1])


def _megatron_fp8_child(port: int, out: "mp.Queue") -> None:
    """Runs in a fresh process: megatron-core GPTModel on CPU (gloo, the engine's CPU shim)
    with TE-contract column-parallel linears, wrapped in megatron DDP."""
    try:
        warnings.filterwarnings("ignore")
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        from engine.backends.megatron import cpu_shim

        cpu_shim.apply()
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.tensor_parallel import ColumnParallelLinear
        from megatron.core.transformer.transformer_config import TransformerConfig

        ps.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(0)

        class FP8ColumnParallelLinear(ColumnParallelLinear):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                self._fp8_workspaces = {}

            def forward(self, input_, weight=None, **kw):
                w = self.weight
                ws = self._fp8_workspaces.get("weight")
                if ws is None:
                    ws = self._fp8_workspaces["weight"] = QuantizedWeight(w)
                return super().forward(input_, weight=w + (ws.dequantize(w.dtype) - w).detach(), **kw)

        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
        spec.submodules.self_attention.submodules.linear_qkv = FP8ColumnParallelLinear
        spec.submodules.mlp.submodules.linear_fc1 = FP8ColumnParallelLinear
        cfg = TransformerConfig(
            num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
            normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
            hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32,
            bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
            apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False)
        gpt = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=64,
                       position_embedding_type="rope")
        model = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), gpt)
        ids = torch.randint(0, VOCAB, (2, 16))
        pos = torch.arange(16)[None].expand(2, -1)
        causal = torch.triu(torch.ones(16, 16), 1).bool()[None, None]
        y0 = model(ids, pos, causal)
        y0.float().sum().backward()
        before = fp8_workspace_bytes([model])
        report = offload_params([model], simulate_on_cpu=True)       # a list of model chunks
        after = fp8_workspace_bytes([model])
        onload_params([model], "cpu")
        y1 = model(ids, pos, causal)
        out.put({"before": before, "after": after, "report": asdict(report),
                 "rebuilt": fp8_workspace_bytes([model]), "same_output": bool(torch.equal(y0, y1)),
                 "main_grad_bytes": sum(b.grad_data.numel() * b.grad_data.element_size() for b in model.buffers)})
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - report to the parent, which fails the test
        import traceback

        out.put({"error": f"{e!r}\n{traceback.format_exc()}"})


def test_te_imitating_fp8_workspaces_cleared_in_a_megatron_core_model():
    """A megatron-core GPTModel whose qkv and fc1 linears follow TE's workspace contract,
    wrapped in megatron DDP and passed as a list of chunks: offload clears all 4 workspaces
    with exact bytes in the report, frees the bucketed fp32 main-grad buffer, and the next
    forward rebuilds them with the same output."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install rl[megatron])")
    try:
        import engine.backends.megatron.cpu_shim  # noqa: F401
    except ImportError as e:
        pytest.skip(f"the megatron backend's CPU shim is not importable: {e}")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_megatron_fp8_child, args=(_free_port(), q))
    p.start()
    try:
        res = q.get(timeout=240)
    finally:
        p.join(timeout=60)
    assert "error" not in res, res.get("error")
    # per layer: qkv [(4 + 2*2) * 16, 64] and fc1 [2 * 128, 64]; FP8 data + transpose + fp32 scale
    per_layer = (2 * (8 * 16 * 64) + 4) + (2 * (256 * 64) + 4)
    assert tuple(res["before"]) == (4, 2 * per_layer)
    assert tuple(res["after"]) == (0, 0)
    rep = res["report"]
    assert (rep["fp8_workspaces_cleared"], rep["fp8_workspace_bytes_freed"]) == (4, 2 * per_layer)
    assert rep["grad_bytes_released"] == res["main_grad_bytes"] > 0
    assert tuple(res["rebuilt"]) == (4, 2 * per_layer) and res["same_output"]


# ---- estimates for large configs ----------------------------------------------------------
def test_estimate_7b_and_70b_builtin_configs_offline():
    """7B and 70B Llama-style configs are estimated from built-in architecture numbers on the
    meta device (no download); the numbers are the known ones and the layouts shard them."""
    cfg = RunConfig()
    cfg.model.dtype = "bfloat16"
    cfg.data.max_prompt_length, cfg.rollout.max_new_tokens = 1024, 1024
    e7 = estimate_memory(cfg, model="llama-7b", device_memory_bytes=parse_bytes("80GiB"))
    assert 6.7e9 < e7.param_count < 6.8e9
    assert 13e9 < e7.model_bytes < 14e9                                                # in bf16
    # FSDP2 keeps fp32 parameters (bf16 is its compute copy): params and grads 4 B, AdamW m, v 8 B
    assert e7.per_rank["params"] == e7.param_count * 4 == 2 * e7.model_bytes           # one rank
    assert e7.per_rank["optimizer"] == e7.param_count * 8                              # fp32 m, v
    assert e7.per_rank["grads"] == e7.param_count * 4

    cfg.trainer.nprocs = 8
    e70 = estimate_memory(cfg, model="llama-70b", device_memory_bytes=parse_bytes("80GiB"))
    assert 68.5e9 < e70.param_count < 69.5e9 and 137e9 < e70.model_bytes < 139e9
    assert e70.per_rank["optimizer"] == math.ceil(e70.param_count / 8) * 8
    assert [r.mode for r in e70.offload_matrix] == ["none", "param", "optimizer", "both", "activations", "all"]
    none, both = e70.offload_matrix[0], e70.offload_matrix[3]
    assert both.device_bytes <= none.device_bytes and both.host_bytes > 0 and none.fits is False
    assert all(a.bytes_saved >= b.bytes_saved > 0 for a, b in zip(e70.fixes, e70.fixes[1:]))

    cfg.engine = MegatronEngineConfig(tensor_model_parallel_size=8)
    cfg.trainer.nprocs = 16
    m70 = estimate_memory(cfg, model="llama-70b", device_memory_bytes=parse_bytes("141GB"))
    assert m70.layout == {"nprocs": 16, "dp": 2, "tp": 8, "pp": 1, "cp": 1, "ep": 1}
    assert abs(m70.per_rank["params"] / (e70.model_bytes / 8) - 1) < 0.01
    assert m70.per_rank["grads"] == m70.per_rank["params"] * 2                          # fp32 main grads
    json.loads(json.dumps(m70.to_json(), allow_nan=False))
    assert set(BUILTIN_MODELS) >= {"llama-7b", "llama-70b"}


def test_sampling_ahead_puts_the_rollout_worker_beside_the_ranks():
    """trainer.mode=one_step_off: the rollout worker (engine/trainer/rollout_worker.py) holds the whole
    policy and the KV cache of the whole batch in its own process; the ranks sample only to validate;
    sharing rank 0's GPU, it samples while rank 0 updates, so rank 0's peak is the two together."""
    cfg = RunConfig()
    cfg.model.dtype, cfg.trainer.nprocs, cfg.trainer.val_freq = "bfloat16", 8, 0
    cfg.data.max_prompt_length, cfg.rollout.max_new_tokens = 1024, 1024
    dev = parse_bytes("80GiB")
    sync = estimate_memory(cfg, model="llama-7b", device_memory_bytes=dev)
    assert sync.rollout_worker is None and sync.phase("rollout") is not None
    cfg.trainer.mode = "one_step_off"
    e = estimate_memory(cfg, model="llama-7b", device_memory_bytes=dev)
    w, rows = e.rollout_worker, cfg.data.train_batch_size * cfg.algorithm.rollout_n
    assert w["params"] == e.model_bytes == e.param_count * 2                     # unsharded, in bf16
    assert w["kv_cache"] == 2 * 32 * 32 * 128 * 2 * 2048 * rows                  # K, V x layers x heads x dim x B
    assert w["rank0_peak_if_shared"] == e.peak_bytes + w["total"]
    assert e.phase("rollout") is None and e.peak_bytes == sync.phase("update").total
    assert any("shares rank 0's device" in n for n in e.notes)
    cfg.trainer.val_freq = 5  # validation samples on the ranks, with the weights they train
    assert estimate_memory(cfg, model="llama-7b", device_memory_bytes=dev).phase("rollout") is not None


def test_estimate_from_a_local_hf_config_dir(tmp_path):
    """A local HF directory's config.json is enough (Qwen2-style here: q/k/v bias, tied)."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 1000, "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "tie_word_embeddings": True}))
    cfg = RunConfig()
    cfg.model.path = str(tmp_path)
    e = estimate_memory(cfg)
    per_layer = 128 * 128 + 128 + 2 * (128 * 64 + 64) + 128 * 128 + 3 * 128 * 256 + 2 * 128
    assert e.param_count == 1000 * 128 + 3 * per_layer + 128
    assert e.model.endswith("config.json")


# ---- reports ------------------------------------------------------------------------------
def test_report_json_is_valid_and_records_round_trip(tmp_path):
    """Everything `rl mem-report --json` prints is strict JSON; measured records survive the
    memory.jsonl round trip; the FP8 summary sums what offloads cleared."""
    tracker = MemoryTracker("cpu", models=FP8Net())
    net = tracker._models["model0"]
    for step in (1, 2):
        with tracker.phase("update", step=step):
            net(torch.randn(4, 16))
        with tracker.phase("offload", step=step):
            tracker.record_offload(offload_params(net))
    path = save_records(tracker.phase_records(), tmp_path)
    loaded = load_records(tmp_path)
    assert path.name == "memory.jsonl" and [r.to_json() for r in loaded] == tracker.records()
    from engine.config.schema import DataConfig

    est = estimate_memory(RunConfig(data=DataConfig(train_batch_size=16)), vocab_size=VOCAB, seq_len=30)
    report = build_report(str(tmp_path), est, loaded)
    doc = json.loads(json.dumps(report.to_json(), allow_nan=False))
    assert doc["fp8"]["offloads"] == 2 and doc["fp8"]["workspaces_cleared"] == 8
    assert doc["fp8"]["last_bytes_freed"] == _expected_workspace_bytes()
    assert doc["steps"] == [1, 2] and {r["phase"] for r in doc["measured"]} == {"update", "offload"}
    assert set(doc["estimate"]["per_rank"]) == set(CATEGORIES)
    assert doc["measured"][0]["categories"]["fp8_workspaces"] == _expected_workspace_bytes()
    assert parse_bytes("80GiB") == 80 << 30 and parse_bytes("141GB") == 141 * 10 ** 9
