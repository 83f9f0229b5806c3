"""rollout=vllm: config refusals, vLLM generation in the torch rollout's layout with the
trainer's log-probs, in-place weight sync (tied embeddings included), and `rl train`.

Every test is marked `vllm`. Those that start vLLM skip (with the import error) where vLLM
cannot be imported; each vLLM start costs ~20-60 s on 2 cores, so they are few and each does
several checks on one engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.config.load import load_run_config
from tests.cli_utils import rl_concurrently
from tests.dist_utils import run_ranks

pytestmark = pytest.mark.vllm

VOCAB, PAD, EOS = 12, 0, 1
# head_dim 32 (128 / 4): the tiny default (64 / 4 = 16) is below vLLM CPU attention's sizes
VLLM_TINY = ["model.hidden_size=128", "model.num_attention_heads=4"]


@pytest.fixture(scope="module")
def vllm_importable():
    from engine.rollout.vllm_sampler import vllm_unavailable_reason

    reason = vllm_unavailable_reason()
    if reason:
        pytest.skip(f"vllm cannot be imported here ({reason}); install it as docs/vllm.md says")


def _cfg(overrides):
    return load_run_config(overrides).config


def test_check_vllm_config_refusals():
    """Config-time refusals instead of wrong results: a head size the CPU attention backend
    lacks (the tiny default's 16) names the fix; with top-p < 1 (vLLM's log-probs are then
    renormalised over the nucleus, low by its mass against the trainer's) every use of them in a
    ratio or a KL is refused; rollout=torch is never checked."""
    from engine.errors import ConfigError
    from engine.rollout.vllm_sampler import check_vllm_config

    cfg = _cfg(["rollout=vllm", "trainer.device=cpu"])
    with pytest.raises(ConfigError) as e:
        check_vllm_config(cfg, 64 // 4, require_installed=False)
    assert "head_dim 16" in e.value.message and "model.hidden_size=128" in e.value.message
    check_vllm_config(_cfg(["rollout=vllm", "trainer.device=cpu", *VLLM_TINY]), 32, require_installed=False)
    kl_reward = _cfg(["rollout=vllm", "trainer.device=cpu", "rollout.top_p=0.9", "algorithm.kl_coef=0.1",
                      "algorithm.use_kl_loss=false"])
    with pytest.raises(ConfigError) as e:
        check_vllm_config(kl_reward, 32, require_installed=False)
    assert "rollout.top_p=1.0" in e.value.message
    check_vllm_config(_cfg(["rollout=torch", "trainer.device=cpu"]), 16)

    # top-p < 1 where a ratio divides by the sampler's log-probs: a mode that samples ahead (PPO's
    # behaviour ratio, or with off_policy_ratio=proximal the rollout weight), or the weight asked
    # for in the sync trainer; the sync trainer's own ratio (against its recomputed log-probs) is fine
    nucleus = ["rollout=vllm", "trainer.device=cpu", *VLLM_TINY, "rollout.top_p=0.9"]
    for extra, names, fix in ((["trainer.mode=one_step_off"], "off_policy_ratio=behavior", "trainer.mode=sync"),
                              (["trainer.mode=one_step_off", "algorithm.off_policy_ratio=proximal"], "rollout_is=token",
                               "trainer.mode=sync"),
                              (["algorithm.rollout_is=sequence"], "rollout_is=sequence", "algorithm.rollout_is=off")):
        with pytest.raises(ConfigError) as e:
            check_vllm_config(_cfg([*nucleus, *extra]), 32, require_installed=False)
        msg = e.value.message
        assert names in msg and "rollout.top_p=1.0" in msg and f"or {fix}" in msg, (extra, msg)
        assert ("or trainer.mode=sync" in msg) == (fix == "trainer.mode=sync"), msg  # a sync run is not told to be
    check_vllm_config(_cfg(nucleus), 32, require_installed=False)
    check_vllm_config(_cfg([*nucleus[:-1], "trainer.mode=one_step_off"]), 32, require_installed=False)


def test_right_padded_layout_equals_torch_sampler():
    """The vLLM sampler lays rows out exactly as TorchSampler does (prompt then response,
    right-padded, response mask, log-probs at response positions)."""
    from engine.rollout.torch_sampler import TorchSampler
    from engine.rollout.vllm_sampler import right_padded_batch

    rows = [[3, 4, 5], [3, 4, 5], [6], [6]]
    resp = [[7, 1], [8, 9, 10], [], [2, 1]]
    lps = [[-0.5, -0.1], [-1.0, -2.0, -3.0], [], [-0.2, -0.3]]
    ours = right_padded_batch(rows, resp, lps, PAD)
    R = max(len(r) for r in resp)
    t_resp = torch.tensor([r + [PAD] * (R - len(r)) for r in resp])
    t_lp = torch.tensor([x + [0.0] * (R - len(x)) for x in lps])
    lengths = torch.tensor([len(r) for r in resp])
    ref = TorchSampler(_cfg([]).rollout, PAD, EOS, torch.device("cpu"))._to_right_padded(rows, t_resp, t_lp, lengths)
    for name in ("input_ids", "attention_mask", "response_mask", "prompt_lengths", "rollout_log_probs"):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name


def test_export_dir_writes_full_weights_and_refuses_partial(tmp_path):
    """The HF directory vLLM starts from: config.json + model.safetensors in the model dtype,
    lm_head dropped for tied models (vLLM ties it itself; safetensors refuses shared storage),
    and a rank whose export is empty or lost tensors since the first write is refused with a
    message, not handed to vLLM (FSDP's rank-0-only full_state_dict gave rank 1 nothing)."""
    from safetensors import safe_open

    from engine.model.build import tiny_hf_config
    from engine.rollout.vllm_weight_sync import HFExportDir

    cfg = _cfg([*VLLM_TINY, "model.tie_word_embeddings=true"])
    emb = torch.randn(VOCAB, 128)
    sd = {"model.embed_tokens.weight": emb, "lm_head.weight": emb, "model.norm.weight": torch.ones(128)}
    d = HFExportDir(tiny_hf_config(cfg.model, VOCAB, PAD, EOS), True, torch.bfloat16)
    try:
        d.write_weights(sd)
        assert (d.path / "config.json").exists()
        with safe_open(str(d.weights_path), "pt") as f:
            assert sorted(f.keys()) == ["model.embed_tokens.weight", "model.norm.weight"]
            assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
        with pytest.raises(RuntimeError, match="full weights on every rank"):
            d.write_weights({})
        with pytest.raises(RuntimeError, match="model.norm.weight"):
            d.write_weights({"model.embed_tokens.weight": emb})
    finally:
        d.remove()
    assert not d.path.exists()


def test_the_weights_go_where_two_copies_fit_and_a_full_disk_says_what_to_do(tmp_path, monkeypatch):
    """The export goes to /dev/shm only when two copies of the weights for each rank on the host
    fit there (a sync writes the new file beside the old); a container's 64 MiB /dev/shm sends it
    to TMPDIR instead of failing at the first write. A disk that fills anyway (safetensors' own
    error) is named with the fix, and the half file is removed; so is a disk that has less room
    than the file, before anything is written."""
    import errno
    import shutil

    import engine.rollout.vllm_weight_sync as ws
    from engine.model.build import tiny_hf_config

    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir(), tmp.mkdir()
    monkeypatch.setattr(ws, "shm_dir", lambda: str(shm))
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr("tempfile.tempdir", None)
    free = {"bytes": 64 << 20}
    real_usage = shutil.disk_usage
    monkeypatch.setattr(ws.shutil, "disk_usage", lambda p: real_usage(p)._replace(free=free["bytes"])
                        if str(p) == str(shm) else real_usage(p))
    assert ws.export_base(20 << 20) == str(shm)   # what is asked for fits
    assert ws.export_base(540 << 20) is None      # two copies of a 135M-parameter bf16 model do not
    free["bytes"] = 1 << 40
    assert ws.export_base(540 << 20) == str(shm)

    cfg = _cfg(VLLM_TINY)
    hf = tiny_hf_config(cfg.model, VOCAB, PAD, EOS)
    free["bytes"] = 64 << 20
    one = ws.HFExportDir(hf, False, torch.float32, weights_bytes=10 << 20)  # 2 x 10 MiB fit in 64
    eight = ws.HFExportDir(hf, False, torch.float32, weights_bytes=10 << 20, host_copies=8)  # 8 ranks' do not
    assert one.path.parent == shm and eight.path.parent == tmp
    one.remove(), eight.remove()
    d = ws.HFExportDir(hf, False, torch.float32, weights_bytes=270 << 20)
    try:
        assert d.path.parent == tmp
        from safetensors import SafetensorError

        def full(*a, **k):  # what safetensors raises when the disk fills (not an OSError)
            Path(a[1]).write_bytes(b"half")
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

        monkeypatch.setattr("safetensors.torch.save_file", full)
        with pytest.raises(OSError) as e:
            d.write_weights({"model.norm.weight": torch.ones(128)})
        assert e.value.errno == errno.ENOSPC and str(tmp) in str(e.value) and "TMPDIR" in str(e.value)
        assert "--shm-size" in str(e.value) and not list(d.path.glob("*.tmp"))
        monkeypatch.setattr(ws.shutil, "disk_usage", lambda p: real_usage(p)._replace(free=1 << 20))
        with pytest.raises(OSError, match="no space left in") as e:
            d.write_weights({"model.norm.weight": torch.ones(1 << 19)})  # 2 MiB > 1 MiB free
        assert e.value.errno == errno.ENOSPC
    finally:
        d.remove()


def test_vllm_starts_from_one_directory_per_architecture(tmp_path):
    """vLLM keys its CUDA compile cache by the model's path: runs of one architecture must start
    from the same directory (else every run compiles from scratch), runs of another from a
    different one; the path does not depend on where the model was read from; a cache that
    cannot be written gives None (the caller starts from its export directory)."""
    from engine.model.build import tiny_hf_config
    from engine.rollout.vllm_weight_sync import start_dir

    cfg = _cfg([*VLLM_TINY])
    a = tiny_hf_config(cfg.model, VOCAB, PAD, EOS)
    b = tiny_hf_config(cfg.model, VOCAB, PAD, EOS)
    b._name_or_path = "/some/other/checkout"
    first = start_dir(a, tmp_path)
    assert first is not None and first.parent == tmp_path / "vllm-start"
    assert start_dir(b, tmp_path) == first and [p.name for p in first.iterdir()] == ["config.json"]
    assert first.stat().st_mode & 0o777 == 0o755, "readable by the other users of a shared cache"
    assert start_dir(a, tmp_path, "cuda1") == first.with_name(first.name + "-cuda1")
    import json
    assert json.loads((first / "config.json").read_text())["hidden_size"] == a.hidden_size
    wider = tiny_hf_config(_cfg([*VLLM_TINY, "model.intermediate_size=384"]).model, VOCAB, PAD, EOS)
    assert start_dir(wider, tmp_path) not in (None, first)
    assert sorted(p.name for p in (tmp_path / "vllm-start").iterdir()) == sorted(
        [first.name, first.name + "-cuda1", start_dir(wider, tmp_path).name]), "no temporary directory left behind"
    (tmp_path / "blocked").write_text("a file where the cache directory would go")
    assert start_dir(a, tmp_path / "blocked") is None


def _vllm_rank(rank, world):
    """One rank: FSDP engine + vLLM sampler on a tied-embedding model (head_dim 32), with a temp
    directory of its own (what the engine leaves there is checked)."""
    import os
    import shutil
    import tempfile
    from pathlib import Path

    tmp = tempfile.mkdtemp(prefix="rank-tmp-")
    os.environ["TMPDIR"], tempfile.tempdir = tmp, tmp  # this process's and the engine processes'
    os.environ["RL_CACHE_DIR"] = os.path.join(tmp, "cache")
    from engine.algorithms.policy_loss import PolicyLoss
    from engine.backends.fsdp import FSDPEngine
    from engine.rollout.vllm_sampler import VLLMSampler

    cfg = _cfg(["rollout=vllm", "trainer.device=cpu", *VLLM_TINY, "model.tie_word_embeddings=true",
                "rollout.temperature=0.7", "rollout.max_new_tokens=9", "data.train_batch_size=4",
                "algorithm.rollout_n=4", "task.num_val=4", "optim.lr=0.05", "optim.warmup_steps=0"])
    eng = FSDPEngine(cfg, "", VOCAB, PAD, EOS, torch.device("cpu"), updates_per_step=1)
    eng.build()
    sampler = VLLMSampler.from_engine(cfg, eng, "", {"size": VOCAB, "pad": PAD, "eos": EOS}, eng.device, rank)
    out = {"startup_s": sampler.startup_s, "ipc_dir": sampler.ipc.path,
           "started_from": sampler.llm.llm_engine.model_config.model,
           "start_dirs": [str(p) for p in Path(tmp, "cache", "vllm-start").iterdir()]}
    try:
        out["ipc_sockets"] = sum(p.is_socket() for p in sampler.ipc.path.iterdir())
        prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [2]]
        batch = sampler.generate(None, prompts, 4, torch.Generator().manual_seed(0))
        out["batch"] = batch
        out["lp_before"], _ = eng.compute_log_probs(batch)
        # the sampling distribution: 2048 samples of one prompt, against the policy's own forward
        big = sampler.generate(None, [[3, 4, 5]], 2048, torch.Generator().manual_seed(5))
        with torch.no_grad(), eng.generation_model() as m:
            out["big_logits"] = m(input_ids=big.input_ids, attention_mask=big.attention_mask).logits.float()
        out["big"] = big
        greedy = [sampler.generate(None, prompts, 1, torch.Generator().manual_seed(s), greedy=True).input_ids
                  for s in (1, 2)]
        out["greedy_equal"] = torch.equal(greedy[0], greedy[1])
        out["check_fresh"] = sampler.verify_sync(eng, batch)
        # one optimizer step that moves the policy
        batch.advantages = torch.randn(len(batch), generator=torch.Generator().manual_seed(3))[:, None] \
            * batch.response_mask
        eng.train_step(batch, PolicyLoss(cfg.algorithm, world))
        out["check_stale"] = sampler.verify_sync(eng, batch, raise_on_mismatch=False)
        out["sync_s"] = sampler.sync_weights(eng.export_hf_state_dict())
        out["last_sync"] = sampler.last_sync
        out["check_synced"] = sampler.verify_sync(eng, batch)
        after = sampler.generate(None, prompts, 4, torch.Generator().manual_seed(4))
        out["after"] = after
        out["lp_after"], _ = eng.compute_log_probs(after)
        out["memory"] = sampler.memory()
        # rl's vLLM plugin was loaded in vLLM's worker process, with the environment that turns it on
        out["plugin_on"] = sampler.llm.collective_rpc("rl_plugin_on")
        # an export that lacks a tensor is refused, not loaded around (it would keep its old values)
        from safetensors.torch import save_file

        partial = Path(tmp, "partial")
        partial.mkdir()
        sd = {k: v for k, v in eng.export_hf_state_dict().items() if k != "model.norm.weight"}
        save_file({k: v.contiguous() for k, v in sd.items() if k != "lm_head.weight"}, str(partial / "model.safetensors"))
        try:
            sampler.llm.collective_rpc("rl_reload_weights", args=(str(partial), True))
            out["partial"] = "loaded"
        except Exception as e:
            out["partial"] = str(e)
    finally:
        procs = sampler.llm.llm_engine.engine_core.resources.engine_manager.processes
        sampler.shutdown()
    out["engine_exitcodes"] = [p.exitcode for p in procs]  # -9: vLLM killed it after its 5 s deadline
    # torch's compile cache (torchinductor_<user>) is a cache, meant to stay; sockets are not
    out["left_in_tmp"] = sorted(str(p.relative_to(tmp)) for p in Path(tmp).rglob("*")
                                if p.is_socket() or p.name.startswith("rl-vllm"))
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def test_each_engine_gets_a_socket_directory_and_the_users_path_is_kept(tmp_path, monkeypatch):
    """vLLM's socket path: a directory of rl's per engine (a killed owner's is swept:
    tests/test_owned_dirs.py), the variable put back when the engine's directory is removed (a
    later vLLM of the process, or a child's, was pointed at a removed directory and failed to
    bind), the user's VLLM_RPC_BASE_PATH as it is, and vLLM's default where the temp directory is
    too long for a socket path under it."""
    import os
    import shutil
    import tempfile

    from engine.rollout import vllm_ipc

    short = Path(tempfile.mkdtemp(prefix="ipc-", dir="/tmp"))  # tmp_path is too long for a socket path
    try:
        monkeypatch.setattr(tempfile, "tempdir", str(short))
        monkeypatch.delenv(vllm_ipc.ENV, raising=False)
        ipc = vllm_ipc.IpcDir()
        ipc.open()
        first = ipc.path
        assert first.parent == short and first.name.startswith("rl-vllm-ipc-")
        assert os.environ[vllm_ipc.ENV] == str(first)
        ipc.remove()
        assert not first.exists() and vllm_ipc.ENV not in os.environ  # nothing points at a removed directory
        ipc.open()  # the next engine of this process gets a directory of its own
        assert ipc.path.exists() and ipc.path != first and os.environ[vllm_ipc.ENV] == str(ipc.path)
        other = vllm_ipc.IpcDir()  # a second engine while the first is up
        other.open()
        assert os.environ[vllm_ipc.ENV] == str(other.path) != str(ipc.path)
        other.remove()
        assert os.environ[vllm_ipc.ENV] == str(ipc.path)  # back to the first's, which is still there
        ipc.remove()
        assert vllm_ipc.ENV not in os.environ
        monkeypatch.setenv(vllm_ipc.ENV, str(short / "users"))
        ipc.open()
        assert ipc.path is None and os.environ[vllm_ipc.ENV] == str(short / "users")
        monkeypatch.delenv(vllm_ipc.ENV)
        long_tmp = tmp_path / ("x" * 60)
        long_tmp.mkdir()
        monkeypatch.setattr(tempfile, "tempdir", str(long_tmp))
        ipc.open()
        assert ipc.path is None and vllm_ipc.ENV not in os.environ and list(long_tmp.iterdir()) == []
    finally:
        shutil.rmtree(short, ignore_errors=True)


def test_on_cuda_torch_cache_is_emptied_before_every_wake(monkeypatch):
    """A colocated vLLM on a GPU sleeps while the ranks update; its engine process then wakes
    into memory this process's torch may still hold cached (the update's, the weight export's).
    Every wake (a sync's two, and a plain one before sampling) comes after torch.cuda.empty_cache.
    vLLM's sleep mode needs CUDA, so the engine here is a recorder of the calls the sampler makes
    on vLLM's LLM (their names and arguments as in vLLM 0.32)."""
    from engine.rollout.vllm_sampler import VLLMSampler

    calls = []

    class LLM:
        def wake_up(self, tags=None):
            calls.append(("wake_up", tags))

        def sleep(self, level):
            calls.append(("sleep", level))

        def collective_rpc(self, name, args=()):
            calls.append((name,))
            return [{"seconds": 0.0, "lm_head_reprocessed": False}]

        def reset_prefix_cache(self):
            return True

    class Export:
        path = "/nonexistent"

        def write_weights(self, sd):
            calls.append(("write_weights",))
            return 0

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache",)))
    s = object.__new__(VLLMSampler)
    s.llm, s.export, s.on_cuda, s.asleep, s.tied = LLM(), Export(), True, False, False
    s.sleep()
    s.sync_weights({})
    assert calls == [("sleep", 1), ("empty_cache",), ("wake_up", ["weights"]), ("write_weights",),
                     ("rl_reload_weights",), ("empty_cache",), ("wake_up", ["kv_cache"])]
    calls.clear()
    s.sleep()
    s.wake_up()
    assert calls == [("sleep", 1), ("empty_cache",), ("wake_up", None)]
    calls.clear()
    s.on_cuda, s.asleep = False, False  # CPU: no sleep mode, nothing emptied
    s.sleep()
    s.wake_up()
    assert calls == []


def _engine_kwargs(monkeypatch, tmp_path, device: torch.device, overrides=()) -> dict:
    """The keyword arguments VLLMSampler._start gives vllm.LLM for ``device`` (a recorder stands
    in for vLLM: the GPU arguments cannot start an engine on a CPU machine)."""
    import sys
    import types

    from engine.rollout.vllm_sampler import VLLMSampler

    seen = {}
    monkeypatch.setenv("RL_CACHE_DIR", str(tmp_path))

    class LLM:  # records its arguments and the RPCs made to it
        def __init__(self, **kw):
            seen.update(kw, rpcs=[])

        def collective_rpc(self, method, args=()):
            seen["rpcs"].append((method, args))

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    s = object.__new__(VLLMSampler)
    s.cfg = _cfg(["rollout=vllm", *VLLM_TINY, *overrides])
    s.rcfg, s.device, s.on_cuda = s.cfg.rollout, device, device.type == "cuda"
    s.dtype, s.max_model_len, s.tied = torch.float32, 64, False
    s.export = types.SimpleNamespace(path="/nonexistent")
    s.ipc = types.SimpleNamespace(open=lambda: None)
    from engine.model.build import tiny_hf_config

    s._start(tiny_hf_config(s.cfg.model, VOCAB, PAD, EOS), 8)
    return seen


def test_engine_runs_on_the_ranks_gpu(monkeypatch, tmp_path):
    """vLLM's one-GPU engine runs on visible device 0 whatever the config's device index
    (v1/executor/uniproc_executor.py takes local_rank from it, gpu_worker.init_device uses
    cuda:{local_rank}); a rank on cuda:N (N > 0: Ray told not to set CUDA_VISIBLE_DEVICES, or a
    device picked by local rank) names its GPU through vLLM's device_ids, else every rank's engine
    lands on GPU 0. Device 0 and the CPU get no device_ids (as before)."""
    kw = _engine_kwargs(monkeypatch, tmp_path, torch.device("cuda", 3))
    assert kw["device_ids"] == [3] and kw["enable_sleep_mode"] is True
    # started without weights, which are then loaded from the export directory
    assert kw["load_format"] == "dummy" and kw["rpcs"] == [("rl_reload_weights", ("/nonexistent", False))]
    assert kw["model"].endswith("-cuda3"), kw["model"]  # one compile cache per device of a host
    for dev in (torch.device("cuda", 0), torch.device("cuda")):
        kw = _engine_kwargs(monkeypatch, tmp_path, dev)
        assert "device_ids" not in kw and kw["enable_sleep_mode"] is True
    assert "device_ids" not in _engine_kwargs(monkeypatch, tmp_path, torch.device("cpu"), ["trainer.device=cpu"])


def test_vllm_generate_logprobs_and_weight_sync(vllm_importable):
    """On one engine start (tied embeddings): (0) 2048 samples of one prompt follow the sampling
    distribution token by token (tests/test_sampling_parity.py's check); (1) generation returns the torch rollout's
    layout: 4 prompts x n=4 rows, prompt-major, right-padded, EOS ends a response;
    (2) vLLM's sampled-token log-probs equal the trainer's recompute at the rollout
    temperature (tolerance 1e-4 nats, fp32; measured ~1e-6); (3) after an optimizer step the
    sync check sees stale weights, after sync_weights it passes, and fresh rollouts' log-probs
    again equal the trainer's (so lm_head followed the tied embedding); (4) memory() reports
    the KV cache and the engine processes; (5) the engine's sockets were in a directory of rl's
    in the temp directory, and no socket or directory of it is left after shutdown (vLLM left ~7
    socket files in /tmp per engine)."""
    (r,) = run_ranks(_vllm_rank, 1)
    assert r["ipc_dir"].name.startswith("rl-vllm-ipc-") and r["ipc_sockets"] >= 1, r
    # vLLM started (without weights) from the config-only directory in rl's cache, not from the
    # run's export directory; (2) below shows the exported weights were loaded into it
    assert r["start_dirs"] == [r["started_from"]], r
    assert r["left_in_tmp"] == [], r["left_in_tmp"]
    # rl's vLLM plugin ran in vLLM's processes (it skips the final GC walk at exit that took an
    # engine core past vLLM's 5 s deadline: engine/rollout/vllm_plugin.py), and the engine core
    # exited on its own after SIGTERM, not killed (-9)
    assert r["plugin_on"] == [True] and r["engine_exitcodes"] == [0], r
    assert "lack 1 of vLLM's parameters (model.norm.weight)" in r["partial"], r["partial"]
    from tests.test_sampling_parity import check_responses_follow

    # (0) every sampled token follows softmax(logits / T) of the policy, EOS at its rate at every step
    big = r["big"]
    assert int((big.response_mask.sum(-1) < 9).sum()) > 50, "rows must end at different steps"
    check_responses_follow(r["big_logits"], big, 0.7, 1.0, EOS, 9, "vllm")
    b = r["batch"]
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [2]]
    assert len(b) == 16 and b.rollout_log_probs.shape == b.input_ids.shape
    for i, p in enumerate(prompts):
        for j in range(4):
            row = i * 4 + j
            assert b.input_ids[row, :len(p)].tolist() == p and int(b.prompt_lengths[row]) == len(p)
            resp = b.input_ids[row][b.response_mask[row] > 0].tolist()
            assert 1 <= len(resp) <= 9
            assert EOS not in resp[:-1] and (resp[-1] == EOS or len(resp) == 9)
            assert int(b.attention_mask[row].sum()) == len(p) + len(resp)
    mask = b.response_mask
    assert bool((b.rollout_log_probs[mask > 0] < 0).all()) and bool((b.rollout_log_probs[mask == 0] == 0).all())
    assert torch.allclose(b.rollout_log_probs * mask, r["lp_before"] * mask, atol=1e-4), \
        (b.rollout_log_probs * mask - r["lp_before"] * mask).abs().max()
    assert r["greedy_equal"]
    assert r["check_fresh"].ok and r["check_fresh"].tokens > 0
    assert not r["check_stale"].ok and r["check_stale"].max_abs > 10 * r["check_stale"].tol
    assert r["check_synced"].ok and r["check_synced"].max_abs < 1e-3, r["check_synced"]
    assert r["last_sync"]["lm_head_reprocessed"]
    a, m2 = r["after"], r["after"].response_mask
    assert torch.allclose(a.rollout_log_probs * m2, r["lp_after"] * m2, atol=1e-4), \
        (a.rollout_log_probs * m2 - r["lp_after"] * m2).abs().max()
    assert r["memory"]["kv_cache_bytes"] > 0 and r["memory"]["engine_rss_bytes"] > 0
    print(f"vllm startup {r['startup_s']:.1f}s, sync {r['sync_s'] * 1000:.1f} ms ({r['last_sync']}), "
          f"checks: fresh {r['check_fresh'].max_abs:.2e}, stale {r['check_stale'].max_abs:.2e}, "
          f"synced {r['check_synced'].max_abs:.2e}; memory {r['memory']}")


def _rl_train(*runs):
    """`rl train --json` for each (run_dir, overrides) at once (independent runs); their summaries."""
    results = rl_concurrently(*(["train", f"checkpoint.dir={run_dir}", "--json", *overrides]
                                for run_dir, overrides in runs), timeout=1200)
    for r in results:
        assert r.returncode == 0, r.stderr[-4000:]
    return [json.loads(r.stdout) for r in results]


@pytest.mark.slow
def test_rl_train_vllm_learns_like_torch(vllm_importable, tmp_path):
    """`rl train rollout=vllm` (weight sync every step, verified every step with
    rollout.verify_sync=true) learns the default echo job as the torch rollout does on the same
    job and seed: reward of the last 10 steps at least double the first 10, and within 0.15 of the
    torch run's over the same steps (sampling streams differ, so not equal).

    All three runs take 20 steps (the vLLM runs' last 10 at least 2.5x their first 10 over seeds
    0-2). The torch run is the reference only: its own learning is tests/test_learning.py's (its
    reward starts higher, ~0.4 over the first 10 steps, so 20 steps leave a 2x check of its own
    too little margin)."""
    job = [*VLLM_TINY, "trainer.device=cpu", "checkpoint.save_final=false"]
    torch_run, vllm_run, ahead_run = _rl_train(
        (tmp_path / "torch", [*job, "trainer.total_steps=20"]),
        (tmp_path / "vllm", [*job, "trainer.total_steps=20", "rollout=vllm", "rollout.verify_sync=true"]),
        (tmp_path / "ahead", [*job, "trainer.total_steps=20", "rollout=vllm", "trainer.mode=one_step_off"]))

    def rows(name):
        return [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines() if x.strip()]

    # trainer.mode=one_step_off: vLLM in the rollout worker samples step k+1 during step k's update
    # (docs/async.md). It learns too; at step 1 (weights not yet updated) vLLM's log-probs equal the
    # trainer's; from step 2 on, every sample is exactly one policy version old.
    assert ahead_run["reward_last10"] >= 2 * ahead_run["reward_first10"], ahead_run
    ahead = rows("ahead")
    assert len(ahead) == 20
    assert ahead[0]["staleness"]["max"] == 0 and abs(ahead[0]["algo"]["rollout_ratio_max"] - 1) < 1e-3, ahead[0]
    assert all(r["staleness"]["max"] == 1 and r["staleness"]["rows_1"] == 32 * 8 for r in ahead[1:])
    assert [r["step"] for r in rows("torch")] == list(range(1, 21))
    torch_11_20 = torch_run["reward_last10"]
    print(f"torch {torch_run['reward_first10']:.3f} -> {torch_11_20:.3f}; vllm {vllm_run['reward_first10']:.3f} -> "
          f"{vllm_run['reward_last10']:.3f}; ahead {ahead_run['reward_first10']:.3f} -> {ahead_run['reward_last10']:.3f}; "
          f"wall torch {torch_run['wall_time_s']:.0f}s vllm {vllm_run['wall_time_s']:.0f}s")
    assert vllm_run["last_step"] == 20 and vllm_run["reward_last10"] >= 2 * vllm_run["reward_first10"], vllm_run
    assert abs(vllm_run["reward_last10"] - torch_11_20) <= 0.15, (torch_11_20, vllm_run)
