"""Tracking: trainer.loggers through the real libraries (TensorBoard, wandb offline, MLflow),
read back with their own readers; sample rows; the metrics the loss and the trainer add."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from wandb_records import history, run_ids  # noqa: E402

from engine.batch import SequenceBatch  # noqa: E402
from engine.errors import ConfigError, UserError  # noqa: E402

ALL = "trainer.loggers=[console,jsonl,tensorboard,wandb,mlflow]"
ANSI = re.compile(r"\x1b\[")


def rl(*args, timeout=900):
    """The real CLI; W&B offline and MLflow's store inside the run directory, whatever this machine has."""
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "MLFLOW_TRACKING_URI")}
    env["WANDB_MODE"] = "offline"
    return subprocess.run([sys.executable, "-m", "rlcli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def flat(text: str) -> str:
    return " ".join(text.replace("│", " ").split())


# ---- config ----------------------------------------------------------------------------------
def test_unknown_logger_is_refused_with_a_suggestion():
    from engine.config.validate import build_run_config

    with pytest.raises(ConfigError) as e:
        build_run_config({"trainer": {"loggers": ["console", "tensorbord"]}})
    assert "Did you mean `tensorboard`" in e.value.message


def test_missing_logger_package_fails_before_anything_starts(tmp_path):
    """A logger whose package cannot be imported stops `rl train` at config time: exit 2, the
    message names the extra to install, no traceback, no run directory created."""
    code = ("import sys; sys.modules['mlflow'] = None; from rlcli.main import main; "
            f"sys.argv = ['rl', 'train', 'trainer.loggers=[console,mlflow]', 'checkpoint.dir={tmp_path / 'run'}']; "
            "main()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "pip install 'rl[tracking]'" in flat(r.stderr) and "mlflow" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()


# ---- metrics the loss and the trainer add ---------------------------------------------------
def _batch(resp_tokens: list[list[int]], eos: int = 9, prompt_len: int = 2) -> SequenceBatch:
    T = prompt_len + max(len(r) for r in resp_tokens)
    B = len(resp_tokens)
    ids = torch.zeros(B, T, dtype=torch.long)
    att = torch.zeros(B, T, dtype=torch.long)
    resp = torch.zeros(B, T)
    for i, r in enumerate(resp_tokens):
        ids[i, :prompt_len] = 1
        ids[i, prompt_len:prompt_len + len(r)] = torch.tensor(r)
        att[i, :prompt_len + len(r)] = 1
        resp[i, prompt_len:prompt_len + len(r)] = 1
    return SequenceBatch(ids, att, resp, torch.full((B,), prompt_len))


def test_truncated_fraction_counts_responses_cut_at_max_new_tokens():
    from engine.trainer.trainer import truncated_fraction

    eos = 9
    b = _batch([[3, 4, 5, 6], [3, 4, 5, eos], [3, eos], [4, 4, 4, 4]], eos=eos)
    assert truncated_fraction(b, max_new_tokens=4, ends=[eos]) == pytest.approx(0.5)   # rows 0 and 3
    assert truncated_fraction(b, max_new_tokens=5, ends=[eos]) == 0.0
    # a model with another end token (Gemma's <end_of_turn>): row 0 ending with it was not cut
    assert truncated_fraction(b, max_new_tokens=4, ends=[eos, 6]) == pytest.approx(0.25)  # row 3
    # multi-turn: two model turns of 3 and 2 tokens with the environment's tokens between them
    # (mask 0): 5 model tokens, but no turn reached a limit of 4
    turns = _batch([[3, 4, 5, 7, 7, 3, 4]], eos=eos)
    turns.response_mask[0, turns.prompt_lengths[0] + 3:turns.prompt_lengths[0] + 5] = 0
    assert truncated_fraction(turns, max_new_tokens=4, ends=[eos]) == 0.0
    assert truncated_fraction(turns, max_new_tokens=2, ends=[eos]) == 1.0  # its last turn is 2 long, no end


def test_policy_loss_reports_clip_fraction_and_rollout_kl():
    """clip_frac is the token-mean of 'the clip was active'; rollout_kl is the k3 estimate of
    KL(sampler || trainer) on the response tokens."""
    from engine.algorithms.policy_loss import PolicyLoss
    from engine.config.schema import AlgorithmConfig

    b = _batch([[3, 4, 5, 6], [3, 4, 5, 6]])
    mask = b.response_mask
    log_p = torch.full(mask.shape, -1.0)
    # ratio exp(0.5) > 1.28 on row 0 with positive advantage -> clipped; row 1 ratio 1 -> not clipped
    b.old_log_probs = log_p.clone()
    b.old_log_probs[0] -= 0.5
    b.advantages = torch.ones(mask.shape)
    b.rollout_log_probs = log_p - 0.1 * mask
    loss = PolicyLoss(AlgorithmConfig(), world_size=1)
    _, m = loss(log_p, None, b, n_tokens=float(mask.sum()), n_seqs=2.0)
    assert m["clip_frac"] == pytest.approx(0.5)
    d = torch.tensor(-0.1)
    assert m["rollout_kl"] == pytest.approx(float(torch.exp(-d) + d - 1), rel=1e-4)


def test_step_metrics_use_the_four_namespaces():
    from engine.tracking.names import step_metrics
    from engine.events import StepRecord

    rec = StepRecord(step=3, reward_mean=0.5, accuracy=None, kl=None, pg_loss=0.1, entropy=1.0, grad_norm=2.0,
                     lr=1e-3, response_len_mean=5.0, rollout_tokens_per_s=10.0, update_tokens_per_s=20.0,
                     step_time_s=0.3, peak_mem_bytes=100, pad_fraction=0.1, distinct_shapes=1,
                     timing={"rollout": 0.1}, clip_frac=0.2, rollout_kl=0.01, adv_mean=0.0, adv_std=1.0,
                     adv_min=-1.0, adv_max=1.0, response_len_min=1, response_len_max=9, response_clip_frac=0.25,
                     mem_peaks={"activations_bytes": 7})
    m = step_metrics(rec.to_json())
    assert all(k.split("/")[0] in ("train", "val", "perf", "mem") for k in m)
    assert m["train/reward"] == 0.5 and m["train/clip_frac"] == 0.2 and m["train/rollout_kl"] == 0.01
    assert m["train/response_clip_frac"] == 0.25 and m["train/advantage_std"] == 1.0
    assert m["perf/time/rollout"] == 0.1 and m["mem/activations_bytes"] == 7 and m["train/lr"] == 1e-3
    assert "train/accuracy" not in m  # None values are not logged


def test_sample_rows_spread_over_distinct_prompts():
    from engine.tracking.samples import pick_rows

    prompts = ["p0", "p1", "p2", "p3"]
    responses = [f"r{i}" for i in range(8)]  # 2 per prompt, prompt-major
    rows = pick_rows(5, 2, prompts, responses, [float(i) for i in range(8)], [0.0] * 8, ["a"] * 4, group=2)
    assert [(r["prompt"], r["response"], r["reward"]) for r in rows] == [("p0", "r0", 0.0), ("p2", "r4", 4.0)]
    assert all(r["step"] == 5 for r in rows)


def test_a_failing_logger_is_reported_as_a_user_error(tmp_path, monkeypatch):
    """MLflow pointed at a tracking URI it cannot use: the run's next event raises a UserError
    naming the logger (the CLI turns it into exit 2), not a thread's silent death."""
    from engine.config.validate import build_run_config
    from engine.tracking.fanout import Tracking
    from engine.events import Validation

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://x")
    cfg = build_run_config({"trainer": {"loggers": ["jsonl", "mlflow"]}})
    t = Tracking(cfg, tmp_path)
    deadline = time.monotonic() + 120  # opening fails in the logger thread, which then drains until close
    while t._error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(UserError) as e:
        t.on_event(Validation(0, None, 0.5))
    assert "mlflow logger failed" in e.value.message
    t.close(failed=True)


# ---- the real thing: rl train + two resumes, every logger on -------------------------------
def _tb_scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Scalars through tensorboard's EventAccumulator; the samples text through the plugin
    EventAccumulator that the TensorBoard server itself uses (the legacy one does not purge
    tensor events on a restart)."""
    from tensorboard.backend.event_processing import plugin_event_accumulator
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    ea.Reload()
    out = {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}
    pea = plugin_event_accumulator.EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0})
    pea.Reload()
    out["samples"] = [(e.step, 0.0) for e in pea.Tensors("samples/text_summary")]
    out["plugin/train/reward"] = [(e.step, 0.0) for e in pea.Tensors("train/reward")]
    return out


@pytest.mark.slow
def test_loggers_write_every_step_once_across_resumes(tmp_path):
    """rl train (4 steps, checkpoints at 2 and 4) -> rl resume run/step_2 (rewinds: re-runs 3, 4)
    -> rl resume run trainer.total_steps=6. Read back with each library's own reader:
    TensorBoard (EventAccumulator) has every step exactly once (purge_step drops the rewound
    steps) and the last values metrics.jsonl holds; wandb's offline files all belong to one run
    id and hold each step once; MLflow (MlflowClient) has one run with each step once; sample
    rows land in samples.jsonl (rewards match the task), TensorBoard text, the wandb history and
    MLflow artifacts. Output has no ANSI escapes (not a terminal) and --json stdout is JSON only."""
    from mlflow import MlflowClient

    run = tmp_path / "run"
    common = ["data.train_batch_size=4", "algorithm.rollout_n=2", "trainer.sample_log_freq=2",
              "trainer.sample_log_n=3", "trainer.val_freq=2"]
    r = rl("train", "trainer.total_steps=4", "checkpoint.save_freq=2", "checkpoint.keep_last=0",
           f"checkpoint.dir={run}", ALL, *common, "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["tracking"]["loggers"] == ["jsonl", "tensorboard", "wandb", "mlflow"]
    assert "train/reward" in r.stderr  # the summary's reward chart (stderr under --json)
    assert not ANSI.search(r.stdout + r.stderr)
    state = json.loads((run / "tracking.json").read_text())

    r = rl("resume", str(run / "step_2"))
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-2000:]
    r = rl("resume", str(run), "trainer.total_steps=6", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    json.loads(r.stdout)
    assert not ANSI.search(r.stdout + r.stderr)
    assert json.loads((run / "tracking.json").read_text()) == state  # same wandb and MLflow runs

    rows = {m["step"]: m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]

    # TensorBoard
    tb = _tb_scalars(run)
    for tag in ("train/reward", "train/clip_frac", "train/grad_norm", "perf/step_time_s", "perf/time/rollout",
                "train/response_len_max", "mem/peak_bytes"):
        assert [s for s, _ in tb[tag]] == [1, 2, 3, 4, 5, 6], (tag, tb[tag])
    assert [v for _, v in tb["train/reward"]] == pytest.approx([rows[s]["reward_mean"] for s in range(1, 7)])
    assert [s for s, _ in tb["val/reward"]] == [0, 2, 4, 6]
    assert [s for s, _ in tb["perf/time/save_checkpoint"]] == [2, 4, 6]
    assert [s for s, _ in tb["samples"]] == [2, 4, 6]
    assert [s for s, _ in tb["plugin/train/reward"]] == [1, 2, 3, 4, 5, 6]

    # wandb (offline): one run id; every step's history row exactly once over all segments
    files = sorted(run.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 3
    assert {i for f in files for i in run_ids(f)} == {state["wandb_run_id"]}
    hist = [h for f in files for h in history(f)]
    steps = Counter(h["_step"] for h in hist if "train/reward" in h)
    assert steps == Counter({s: 1 for s in range(1, 7)})
    by_step = {h["_step"]: h for h in hist if "train/reward" in h}
    assert by_step[5]["train/reward"] == pytest.approx(rows[5]["reward_mean"])
    tables = {h["_step"]: h["samples"] for h in hist if "samples" in h}
    assert sorted(tables) == [2, 4, 6] and all(t["_type"] == "table-file" for t in tables.values())
    table = json.loads(next(run.glob("wandb/offline-run-*/files/media/table/samples_6_*.table.json")).read_text())
    assert table["columns"][:4] == ["step", "prompt", "response", "reward"] and len(table["data"]) == 3

    # MLflow: the store inside the run directory, one run
    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    runs = client.search_runs([state["mlflow_experiment_id"]])
    assert [x.info.run_id for x in runs] == [state["mlflow_run_id"]]
    assert runs[0].info.status == "FINISHED"
    reward = client.get_metric_history(state["mlflow_run_id"], "train/reward")
    assert sorted(m.step for m in reward) == [1, 2, 3, 4, 5, 6]
    assert {m.step: m.value for m in reward}[6] == pytest.approx(rows[6]["reward_mean"])
    assert runs[0].data.params["trainer.sample_log_freq"] == "2"
    arts = sorted(a.path for a in client.list_artifacts(state["mlflow_run_id"], "samples"))
    assert arts == ["samples/step_000002.json", "samples/step_000004.json", "samples/step_000006.json"]

    # samples.jsonl: 3 rows per sample step, no step twice, rewards are the task's
    from engine.config.schema import TaskConfig
    from engine.tasks.registry import make_task

    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert Counter(s["step"] for s in samples) == Counter({2: 3, 4: 3, 6: 3})
    task = make_task(TaskConfig(), 0)
    for s in samples:
        assert s["reward"] == pytest.approx(task.reward(s["prompt"], s["response"], s["answer"]))
