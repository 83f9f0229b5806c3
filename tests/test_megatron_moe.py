"""Mixture-of-experts on the megatron engine (docs/megatron.md "MoE", docs/moe.md): a tiny
Hugging Face Mixtral converted to megatron-core's expert layout computes the FSDP engine's
log-probs and takes its update, at EP=1 and with the experts split over 2 gloo ranks (EP=2); a
checkpoint written at EP=2 resumes exactly at EP=1; routing replay through megatron-core's
routers reproduces a rollout that routed differently, pads taking the router's own choice."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron

LP_TOL = 1e-5     # log-probs, megatron vs FSDP (same weights, fp32)
STEP_TOL = 1e-5   # weights after one AdamW step (eps 1e-6, lr 1e-3)
EXPERTS = 4


class _TokenMeanPG:
    """-A * log p over the global batch's response tokens, scaled by the DP size (undoing the DP
    mean of gradients), as tests/test_megatron.py's."""

    needs_entropy = False

    def __init__(self, dp_size: int):
        self.dp_size = dp_size

    def __call__(self, lp, ent, mb, n_tokens, n_seqs):
        loss = -(mb.advantages * lp * mb.response_mask).sum() / n_tokens
        return loss * self.dp_size, {"pg_loss": float(loss)}


def _cfg(path, engine: str, *extra):
    from engine.config.load import load_run_config

    over = [f"model.path={path}", "rollout.max_new_tokens=6", "trainer.nprocs=2", "optim.lr=1e-3",
            "optim.eps=1e-6", "optim.warmup_steps=0", "optim.grad_clip=1.0", "engine.micro_batch_size=2", *extra]
    return load_run_config(over, engine=engine).config


def _engine(path, tok, engine: str, *extra):
    cfg = _cfg(path, engine, *extra)
    if engine == "megatron":
        from engine.backends.megatron.engine import MegatronEngine as E
    else:
        from engine.backends.fsdp import FSDPEngine as E
    e = E(cfg, str(path), tok.vocab_size, tok.pad_token_id, tok.eos_token_id, torch.device("cpu"), 2)
    e.build()
    return cfg, e


def _second_choice(model):
    """The rollout's routers pick their 2nd..k+1th experts: routing, and nothing else, differs."""
    from engine.moe.router_replay import gate_weights
    from engine.moe.routers import find_routers

    def hook(mod, args, out):
        logits, scores, _ = out
        idx = torch.softmax(logits, -1, dtype=torch.float).topk(mod.top_k + 1, -1).indices[:, 1:]
        return logits, gate_weights(mod, logits, idx, scores.dtype), idx

    return [m.register_forward_hook(hook, prepend=True) for _, m in find_routers(model)]


def _rollout(cfg, eng, tok, rank: int, perturb: bool):
    """This rank's rows (rank 0: 6, rank 1: 3, so the ranks run different micro-batch counts and
    shapes) with random advantages."""
    from engine.rollout.torch_sampler import TorchSampler

    sampler = TorchSampler(cfg.rollout, tok.pad_token_id, tok.eos_token_id, eng.device, record_routing=True)
    prompts = [tok.encode("abc:")] if rank else [tok.encode("ab:"), tok.encode("c:"), tok.encode("abcd:")]
    with eng.generation_model() as m:
        handles = _second_choice(m) if perturb else []
        try:
            b = sampler.generate(m, prompts, 3 if rank else 2, torch.Generator().manual_seed(rank))
        finally:
            for h in handles:
                h.remove()
    g = torch.Generator().manual_seed(10 + rank)
    b.advantages = (torch.randn(len(b), 1, generator=g) * b.response_mask).contiguous()
    return b


def _session(rank, world, path, workdir):
    import torch.distributed.checkpoint as dcp

    from tests.tiny_hf import char_tokenizer

    warnings.filterwarnings("ignore")
    tok = char_tokenizer()
    out: dict = {}
    # FSDP2 reference (DP=2): log-probs and one step
    fcfg, fsdp = _engine(path, tok, "fsdp")
    batch = _rollout(fcfg, fsdp, tok, rank, perturb=False)
    second = _rollout(fcfg, fsdp, tok, 1 - rank, perturb=False)
    out["rows"] = len(batch)
    f_lp, _ = fsdp.compute_log_probs(batch)
    fsdp.train_step(batch, _TokenMeanPG(world))
    f_after = fsdp.export_hf_state_dict()
    del fsdp

    for ep in (1, 2):
        cfg, eng = _engine(path, tok, "megatron", f"engine.expert_model_parallel_size={ep}")
        r = out[f"ep{ep}"] = {"local_experts": sum(".local_experts." in n for n in eng._params) // 2 // 2}
        lp, _ = eng.compute_log_probs(batch)
        r["lp_err"] = float(((lp - f_lp) * batch.attention_mask).abs().max())
        eng.train_step(batch, _TokenMeanPG(eng.dp_size))
        after = eng.export_hf_state_dict()
        if rank == 0:  # FSDP's full state dict lands on rank 0
            r["step_err"] = max(float((after[k] - f_after[k]).abs().max()) for k in after)
            r["same_keys"] = set(after) == {k for k in f_after if k != "lm_head.weight" or k in after}
        if ep == 2:
            state = eng.checkpoint_state()
            r["ckpt_expert_shape"] = tuple(state["model"]["model.layers.0.mlp.experts.gate_up_proj"].shape)
            r["ckpt_moment_shape"] = tuple(state["optim"]["state.model.layers.0.mlp.experts.down_proj.exp_avg"].shape)
            r["coverage"] = eng.optimizer_coverage()
            r["shapes"] = eng.param_shapes()
            dcp.save(state, checkpoint_id=os.path.join(workdir, "ckpt_ep2"))
            r["after1"] = after
            eng.train_step(second, _TokenMeanPG(eng.dp_size))
            r["after2"] = eng.export_hf_state_dict()
        del eng
    # resume the EP=2 checkpoint at EP=1 (every rank holds every expert)
    cfg, eng = _engine(path, tok, "megatron", "engine.expert_model_parallel_size=1")
    state = eng.checkpoint_state()
    dcp.load(state, checkpoint_id=os.path.join(workdir, "ckpt_ep2"))
    eng.load_checkpoint_state(state)
    loaded = eng.export_hf_state_dict()
    out["resume_load_exact"] = all(torch.equal(loaded[k], out["ep2"]["after1"][k]) for k in loaded)
    eng.train_step(second, _TokenMeanPG(eng.dp_size))
    nxt = eng.export_hf_state_dict()
    out["resume_step_err"] = max(float((nxt[k] - out["ep2"]["after2"][k]).abs().max()) for k in nxt)
    for k in ("after1", "after2"):
        out["ep2"].pop(k)
    del eng
    # routing replay at EP=2: the rollout routed to 2nd choices
    cfg, eng = _engine(path, tok, "megatron", "engine.expert_model_parallel_size=2", "algorithm.router_replay=replay")
    pert = _rollout(cfg, eng, tok, rank, perturb=True)
    replayed, _ = eng.compute_log_probs(pert)
    out["replay_err"] = float(((replayed - pert.rollout_log_probs) * pert.response_mask).abs().max())
    out["report"] = eng.routing_report(pert)
    out["replay_step_finite"] = bool(torch.isfinite(torch.tensor(
        eng.train_step(pert, _TokenMeanPG(eng.dp_size)).replicated["grad_norm"])))
    out["pads"] = _pad_check(eng, pert)
    return out


def _pad_check(eng, batch):
    """In a replayed forward, tokens without a record (pads) route as the router chooses; every
    recorded token takes its record, also where it disagrees with the router."""
    from engine.moe.routing_records import NO_RECORD

    from engine.batching.microbatch import _pad_columns

    rr = eng.router_replay
    T = 16  # one shape on both ranks: at EP=2 every MoE layer all-gathers the ranks' tokens
    b = _pad_columns(batch.select(list(range(2))), T, 2, eng.pad_token_id)
    with torch.no_grad(), rr.recording():
        eng._forward_logits(eng.model, b)
        own = rr.take(2, T).long()
    rec = ((own + 1) % EXPERTS).to(torch.int16)   # a routing the router would not choose
    rec[:, T // 2:] = NO_RECORD
    with torch.no_grad(), rr.replaying(rec, capture=True):
        eng._forward_logits(eng.model, b)
        again = rr.take(2, T).long()             # the router's own choice in the replayed forward
    # what the experts received: capture through a second replay that records the chosen indices
    used = []
    topk = [r.router_replay.get_replay_topk for r in _routers(eng)]
    for r, f in zip(_routers(eng), topk):
        def spy(*a, _f=f, **kw):
            v, i = _f(*a, **kw)
            used.append(i.clone())
            return v, i
        r.router_replay.get_replay_topk = spy
    try:
        with torch.no_grad(), rr.replaying(rec):
            eng._forward_logits(eng.model, b)
    finally:
        for r, f in zip(_routers(eng), topk):
            r.router_replay.get_replay_topk = f
    from engine.backends.megatron.routing_replay import batch_first

    used = batch_first(torch.stack(used, 1), 2, T).long()
    return {"recorded_used": torch.equal(used[:, : T // 2], rec.long()[:, : T // 2]),
            "pads_own": torch.equal(used[:, T // 2:], again[:, T // 2:]),
            "records_disagree": bool((rec.long()[:, : T // 2] != again[:, : T // 2]).any())}


def _routers(eng):
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in eng.model.module.modules() if isinstance(m, TopKRouter)]


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    from tests.dist_utils import run_ranks
    from tests.tiny_hf import save_tiny_model

    root = tmp_path_factory.mktemp("megatron_moe")
    path = save_tiny_model("mixtral", root / "mixtral", experts=EXPERTS)
    res = run_ranks(_session, 2, str(path), str(root))
    print("\nmegatron MoE measured:", {k: ({kk: vv for kk, vv in v.items() if kk not in ("coverage", "shapes")}
                                         if isinstance(v, dict) else v) for k, v in res[0].items() if k != "report"})
    return res


def test_megatron_mixtral_log_probs_and_step_equal_fsdp_at_ep1_and_ep2(session):
    """Same HF Mixtral weights, same rows: the megatron engine's log-probs equal the FSDP
    engine's, and one AdamW step lands on the same weights (experts and routers included), with
    the experts whole on each rank (EP=1) and split over the 2 ranks (EP=2, the allgather
    dispatcher; rank 1 has fewer rows, so it runs a zero-weight twin and padded shapes)."""
    for rank, r in enumerate(session):
        assert r["ep1"]["local_experts"] == EXPERTS and r["ep2"]["local_experts"] == EXPERTS // 2
        for ep in ("ep1", "ep2"):
            assert r[ep]["lp_err"] < LP_TOL, (rank, ep, r[ep]["lp_err"])
    r0 = session[0]
    for ep in ("ep1", "ep2"):
        assert r0[ep]["same_keys"]
        assert r0[ep]["step_err"] < STEP_TOL, (ep, r0[ep]["step_err"])


def test_megatron_moe_checkpoint_holds_whole_experts_and_resumes_ep2_at_ep1(session):
    """The EP=2 checkpoint stores every expert under the HF name ([E, ...], moments too), the
    optimizer covers every tensor, the manifest's shapes are the full ones; loaded at EP=1 the
    weights are bit-identical and the next step equals the EP=2 run's next step."""
    r0 = session[0]
    e = r0["ep2"]
    assert e["ckpt_expert_shape"][0] == EXPERTS and e["ckpt_moment_shape"][0] == EXPERTS
    assert e["coverage"] and all(e["coverage"].values())
    assert e["shapes"]["model.layers.0.mlp.experts.gate_up_proj"]["shape"][0] == EXPERTS
    for r in session:
        assert r["resume_load_exact"]
        assert r["resume_step_err"] < STEP_TOL, r["resume_step_err"]


def test_megatron_replay_at_ep2_reproduces_a_rollout_that_routed_differently(session):
    """The rollout routed every token to its 2nd..3rd choice experts; the megatron engine at EP=2
    replaying the records gives the rollout's log-probs, its own routing does not (the routing
    metrics say so), and a replayed update is finite."""
    from engine.moe.routing_metrics import RoutingSums, summarize

    for r in session:
        assert r["replay_err"] < 1e-5, r["replay_err"]
        m = summarize(RoutingSums(**r["report"]))
        assert m["routing_mismatch"] > 0.9
        assert m["logp_gap_replay"] < 1e-5 and m["logp_gap_no_replay"] > 100 * max(m["logp_gap_replay"], 1e-7)
        assert r["replay_step_finite"]


def test_megatron_replay_pads_take_the_routers_choice(session):
    for r in session:
        p = r["pads"]
        assert p["records_disagree"] and p["recorded_used"] and p["pads_own"], p


def test_megatron_moe_layouts_refused_clearly():
    """Experts with TP > 1, EP not dividing the experts or on a dense model, and an MoE
    architecture without a mapping are ConfigErrors naming the fix."""
    from engine.backends.megatron.model import arch_from_hf_config, check_parallel_layout
    from engine.errors import ConfigError
    from tests.tiny_hf import hf_config

    moe = arch_from_hf_config(hf_config("mixtral", 12, experts=EXPERTS))
    with pytest.raises(ConfigError, match="tensor_model_parallel_size=1"):
        check_parallel_layout(moe, 2, 1)
    with pytest.raises(ConfigError, match="must divide the number of experts"):
        check_parallel_layout(moe, 1, 3)
    with pytest.raises(ConfigError, match="has no experts"):
        check_parallel_layout(arch_from_hf_config(hf_config("llama", 12)), 1, 2)
    with pytest.raises(ConfigError, match="engine=fsdp"):
        arch_from_hf_config(hf_config("qwen3_moe", 12, experts=EXPERTS))


def test_mem_report_counts_expert_params_per_ep_rank(tmp_path):
    """`rl mem-report`'s estimate puts 1/EP of each layer's expert parameters on a rank (the
    router and the dense parts stay whole): params on the rank = total - experts * (1 - 1/EP)."""
    from engine.config.load import load_run_config
    from engine.memory.estimate import estimate_memory
    from tests.tiny_hf import save_tiny_model

    path = save_tiny_model("mixtral", tmp_path / "mixtral", experts=8)
    est = {}
    for ep in (1, 2, 4):
        cfg = load_run_config([f"model.path={path}", "trainer.nprocs=4", f"engine.expert_model_parallel_size={ep}"],
                              engine="megatron").config
        est[ep] = estimate_memory(cfg)
    experts = est[1].moe["expert_params"]
    assert experts > 0 and est[2].layout["ep"] == 2
    for ep in (1, 2, 4):
        assert est[ep].per_rank["params"] == 4 * (est[1].param_count - experts + experts // ep), ep


@pytest.mark.slow
def test_megatron_mixtral_ep2_run_learns_with_replay_and_resumes_at_ep1(tmp_path):
    """`rl train --engine megatron` on a tiny Mixtral with its experts split over 2 gloo ranks
    (EP=2, TP=1) and routing replay learns the default task (last-10 reward at least 2x the
    first 10; docs/megatron.md has the figures), logs the routing metrics, `rl inspect-ckpt` shows
    the experts per layer, and `rl resume` continues the run at EP=1."""
    import json

    from tests.cli_utils import rl
    from tests.tiny_hf import save_tiny_model

    model = save_tiny_model("mixtral", tmp_path / "mixtral", experts=8)
    d = tmp_path / "run"
    r = rl("train", "--engine", "megatron", f"model.path={model}", "trainer.nprocs=2",
           "engine.expert_model_parallel_size=2", "algorithm.router_replay=replay", "trainer.total_steps=30",
           f"checkpoint.dir={d}", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout)
    assert s["reward_last10"] >= 2 * s["reward_first10"], s
    for row in (json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()):
        assert 0.0 <= row["algo"]["routing_mismatch"] <= 1.0 and row["algo"]["logp_gap_replay"] < 1e-4
    shown = json.loads(rl("inspect-ckpt", str(d / "step_30"), "--json").stdout)
    assert shown["info"]["experts"]["experts_per_layer"] == 8
    again = rl("resume", str(d), "trainer.total_steps=32", "engine.expert_model_parallel_size=1", "--json")
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout)["last_step"] == 32


def _aux_loss(rank, world, path):
    import warnings

    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
    from transformers import AutoModelForCausalLM

    from engine.batch import SequenceBatch
    from tests.tiny_hf import char_tokenizer

    warnings.filterwarnings("ignore")
    tok = char_tokenizer()
    cfg, eng = _engine(path, tok, "megatron", "trainer.nprocs=1", "engine.moe_aux_loss_coef=0.01")
    ids = torch.randint(2, tok.vocab_size, (3, 7), generator=torch.Generator().manual_seed(0))
    one = torch.ones_like(ids)
    b = SequenceBatch(input_ids=ids, attention_mask=one, response_mask=one.float(),
                      prompt_lengths=torch.ones(3, dtype=torch.long))
    eng.model.train()
    eng._forward_logits(eng.model, b)
    raw = float(get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"][0])
    hf = AutoModelForCausalLM.from_pretrained(path, output_router_logits=True).float()
    hf_raw = float(hf(input_ids=ids, attention_mask=one).aux_loss)
    return {"megatron_added": eng.tcfg.moe_aux_loss_coeff * raw, "hf_added": 0.01 * hf_raw,
            "default_type": _cfg(path, "megatron", "trainer.nprocs=1").engine.moe_aux_loss_coef}


def test_moe_aux_loss_coef_adds_what_hugging_face_router_aux_loss_coef_adds(tmp_path):
    """engine.moe_aux_loss_coef has transformers' router_aux_loss_coef meaning: on a one-layer
    Mixtral, the load-balancing loss megatron adds (its coefficient x its loss, which averages
    over the k slots) equals 0.01 x the aux_loss transformers computes on the same tokens; the
    default is 0 (the FSDP engine adds none)."""
    from tests.dist_utils import run_ranks
    from tests.tiny_hf import save_tiny_model

    path = save_tiny_model("mixtral", tmp_path / "mixtral1", layers=1, experts=EXPERTS)
    r = run_ranks(_aux_loss, 1, str(path))[0]
    assert r["hf_added"] > 0
    assert abs(r["megatron_added"] - r["hf_added"]) < 1e-6 * max(1.0, r["hf_added"]), r
    assert r["default_type"] == 0.0


@pytest.mark.parametrize("overrides,needle", [
    (["trainer.nprocs=2", "engine.expert_model_parallel_size=4"], "must divide the data-parallel ranks"),
    (["trainer.nprocs=2", "engine.expert_model_parallel_size=2"], "has no experts"),   # the tiny dense model
])
def test_expert_parallel_layouts_refused_at_the_command_line(overrides, needle, tmp_path):
    """An EP size the ranks cannot hold, or EP on a dense model: exit 2, the fix named, no traceback."""
    from tests.cli_utils import cli, flat

    res = cli("train", "--dry-run", "--engine", "megatron", *overrides, f"checkpoint.dir={tmp_path / 'run'}")
    out = flat(res.stdout + (res.stderr or ""))
    assert res.exit_code == 2, out
    assert needle in out and "Traceback" not in out
