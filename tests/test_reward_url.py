"""The remote HTTP scorer (``task.reward_url``) against a real HTTP server this test starts on
127.0.0.1: the request it sends, batching, retries on 5xx and timeouts, refusals of bad replies,
combination with reward functions by weights (each logged on its own), the failure policy, the
preflight's refusal of an unreachable server, and a run that trains end to end against it."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from engine.errors import ConfigError
from engine.rewards.call import Sample
from engine.rewards.compute import RewardError, RewardRunner
from engine.rewards.remote import RemoteScorer, check_reachable
from engine.rewards.scorers import ScorerFailed
from engine.rewards.spec import RewardFnSpec
from tests.cli_utils import rl as run_rl


class Scorer(BaseHTTPRequestHandler):
    """Scores each response by its length; ``server.mode`` makes it misbehave on purpose."""

    def do_POST(self):  # noqa: N802 - http.server's name
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with srv.lock:
            srv.requests.append(body)
            nth = len(srv.requests)
        mode = srv.mode
        if mode == "slow":
            time.sleep(1.5)
        if mode == "503" or (mode == "flaky" and nth <= 2):
            return self._send(503, b'{"error": "busy"}')
        if mode == "400":
            return self._send(400, b"bad request")
        if mode == "notjson":
            return self._send(200, b"<html>oops</html>")
        if mode == "nokey":
            return self._send(200, json.dumps({"scores_x": [1.0]}).encode())
        if mode == "short":
            return self._send(200, json.dumps({"rewards": [1.0]}).encode())
        if mode == "nan":
            return self._send(200, b'{"rewards": [NaN]}')
        rewards = [len(r) / 10 for r in body["responses"]]
        self._send(200, json.dumps({"rewards": rewards, "extra_logs": {}}).encode())

    def _send(self, code: int, data: bytes):
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Scorer)
    srv.daemon_threads = True
    srv.mode, srv.requests, srv.lock = "ok", [], threading.Lock()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}/score"
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def samples(k: int = 5) -> list[Sample]:
    return [Sample(f"say {i}:", "x" * i, str(i), {"level": i, "prompt": "dropped"}, f"train.jsonl row {i}")
            for i in range(k)]


def test_sends_openrlhf_fields_in_batches_and_returns_scores_in_order(server):
    sc = RemoteScorer(server.url, batch_size=2, retries=0)
    got = sc.score(samples(5))
    assert got == [i / 10 for i in range(5)]
    assert [len(r["responses"]) for r in server.requests] == [2, 2, 1]  # ceil(5 / 2) requests
    first = server.requests[0]
    assert first["query"] == ["say 0:", "say 1:x"]  # prompt + response, no chat template
    assert first["prompts"] == ["say 0:", "say 1:"] and first["responses"] == ["", "x"]
    assert first["labels"] == ["0", "1"] and first["rows"] == [{"level": 0}, {"level": 1}]
    sc.close()


def test_retries_503_then_succeeds_and_gives_up_after_the_configured_retries(server):
    server.mode = "flaky"  # 503 on the first two requests
    assert RemoteScorer(server.url, retries=2, backoff_s=0.01).score(samples(3)) == [0.0, 0.1, 0.2]
    assert len(server.requests) == 3
    server.requests.clear()
    server.mode = "503"
    with pytest.raises(ScorerFailed, match=r"HTTP 503 after 1 retry") as e:
        RemoteScorer(server.url, retries=1, backoff_s=0.01).score(samples(3))
    assert e.value.rows == [0, 1, 2] and len(server.requests) == 2  # the first try and one retry


def test_a_client_error_is_not_retried(server):
    server.mode = "400"
    with pytest.raises(ScorerFailed, match=r"HTTP 400: 'bad request'"):
        RemoteScorer(server.url, retries=3, backoff_s=0.01).score(samples(2))
    assert len(server.requests) == 1


def test_a_request_past_the_timeout_is_retried_then_fails(server):
    server.mode = "slow"  # answers after 1.5 s
    t0 = time.monotonic()
    with pytest.raises(ScorerFailed, match=r"no reply from .* within task.reward_url_timeout_s=0.3 s \(after 1 retry\)"):
        RemoteScorer(server.url, timeout_s=0.3, retries=1, backoff_s=0.01).score(samples(2))
    assert time.monotonic() - t0 < 1.4  # two tries of 0.3 s, not the server's 1.5 s
    deadline = time.monotonic() + 3
    while len(server.requests) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(server.requests) == 2


@pytest.mark.parametrize("mode, message", [
    ("notjson", r"not JSON: '<html>oops</html>'"),
    ("nokey", r'without a "rewards" key \(keys: scores_x\)'),
    ("short", r"returned 1 score\(s\) for 2 sample\(s\)"),
    ("nan", r"returned nan for sample 0; a reward must be finite"),
])
def test_bad_replies_fail_the_batch_naming_what_is_wrong(server, mode, message):
    server.mode = mode
    with pytest.raises(ScorerFailed, match=message):
        RemoteScorer(server.url, retries=0).score(samples(1 if mode == "nan" else 2))


def test_a_server_that_is_not_there_fails_after_retries(server):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ScorerFailed, match=r"cannot connect to .* after 2 retries \(connection refused\)"):
        RemoteScorer(f"http://127.0.0.1:{port}/", retries=2, backoff_s=0.01).score(samples(1))
    with pytest.raises(ConfigError, match=r"nothing answers at 127.0.0.1:\d+") as e:
        check_reachable(f"http://127.0.0.1:{port}/", 5.0)
    assert e.value.title == "remote scorer unreachable"
    assert "accepts connections" in check_reachable(server.url, 5.0)
    with pytest.raises(ConfigError, match="not an http"):
        check_reachable("ftp://127.0.0.1/x", 5.0)


def _length_fn_spec() -> RewardFnSpec:
    return RewardFnSpec("rl:exact_match", "engine.rewards.builtin:exact_match", 2.0)


def test_runner_adds_the_scorer_by_weight_and_logs_each_source(server):
    """total = 2 x exact_match + 0.5 x remote score, per sample; each source's mean on its own."""
    ss = [Sample("p", "7", "7"), Sample("p", "abcd", "x")]
    runner = RewardRunner([_length_fn_spec()], scorers=[RemoteScorer(server.url, weight=0.5, retries=0)])
    out = runner.score(ss)
    assert out.per_sample_fn == {"rl:exact_match": [1.0, 0.0], "reward_url": [0.1, 0.4]}
    assert out.total == pytest.approx([2.0 + 0.05, 0.2])
    assert out.per_fn == pytest.approx({"rl:exact_match": 0.5, "reward_url": 0.25})
    assert "0.5 x reward_url http://127.0.0.1" in runner.describe()
    runner.close()


def test_failure_policy_matches_reward_functions(server):
    server.mode = "503"
    ss = samples(3)
    zero = RewardRunner([], on_error="zero", scorers=[RemoteScorer(server.url, retries=0, batch_size=2)])
    out = zero.score(ss)
    assert out.total == [0.0, 0.0, 0.0] and len(out.failures) == 1
    assert out.failures[0].fn == "reward_url" and "3 samples" in out.failures[0].origin
    raising = RewardRunner([], on_error="raise", scorers=[RemoteScorer(server.url, retries=0)])
    with pytest.raises(RewardError, match=r"`reward_url` could not score .*HTTP 503") as e:
        raising.score(ss)
    assert e.value.title == "reward scorer failed" and "task.reward_on_error=zero" in e.value.message


def test_partial_failure_keeps_the_batches_that_were_scored(server):
    class HalfBroken(RemoteScorer):
        def _post(self, chunk, first):
            if first:
                raise ScorerFailed("second batch lost", range(first, first + len(chunk)))
            return super()._post(chunk, first)

    out = RewardRunner([], on_error="zero", scorers=[HalfBroken(server.url, retries=0, batch_size=2)]).score(samples(4))
    assert out.total == [0.0, 0.1, 0.0, 0.0] and len(out.failures) == 1


def test_a_dataset_task_may_be_scored_by_the_remote_scorer_alone(server, tmp_path):
    """No reward function: the config loads (before: 'A dataset task needs a reward function'),
    the task has none, and the runner's reward is the scorer's alone."""
    from engine.config.load import load_run_config
    from engine.rewards.compute import make_runner
    from engine.tasks.registry import make_task

    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}", "answer": "a"}) + "\n" for i in range(8)))
    cfg = load_run_config(["task=dataset", f"task.path={tmp_path / 'p.jsonl'}", f"task.reward_url={server.url}",
                           "task.num_val=0"]).config
    task = make_task(cfg.task, 0)
    assert task.reward_specs == [] and task.reward is None
    runner = make_runner(task, cfg.task, (RemoteScorer(server.url, weight=2.0, retries=0),))
    out = runner.score([Sample("q", "abc", "a")])
    assert out.total == pytest.approx([0.6]) and out.per_fn == {"reward_url": pytest.approx(0.3)}


def test_each_reward_source_reaches_the_loggers_under_its_own_name():
    from engine.tracking.names import step_metrics

    got = step_metrics({"reward_mean": 0.4, "reward_fns": {"rl:exact_match": 0.2, "reward_url": 0.4}})
    assert got["train/reward/reward_url"] == 0.4 and got["train/reward/rl:exact_match"] == 0.2
    assert got["train/reward"] == 0.4


# ---- end to end --------------------------------------------------------------------------
SMALL = ["trainer.total_steps=2", "data.train_batch_size=4", "algorithm.rollout_n=2", "rollout.max_new_tokens=4"]


def rl(*args, cwd=None, timeout=600):
    """The real CLI (tests/cli_utils.rl: a run in this process, other commands as a subprocess)."""
    return run_rl(*args, cwd=cwd, timeout=timeout)


@pytest.fixture
def project(tmp_path):
    rows = [{"prompt": f"say {w}:", "answer": w} for w in ["hi", "ok", "yes", "no"] * 4]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


@pytest.mark.slow
def test_a_run_trains_against_a_remote_scorer_combined_with_a_function(server, project):
    r = rl("train", "task=dataset", "task.path=train.jsonl", "task.reward_fn=rl:exact_match",
           f"task.reward_url={server.url}", "task.reward_url_weight=0.5", "task.num_val=0", *SMALL,
           "checkpoint.dir=ck", "--json", cwd=project)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (project / "ck" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        fns = row["reward_fns"]
        assert set(fns) == {"rl:exact_match", "reward_url"}
        assert row["reward_mean"] == pytest.approx(fns["rl:exact_match"] + 0.5 * fns["reward_url"])
    # every sample of both steps went to the server: 4 prompts x 2 samples per step
    assert sum(len(q["responses"]) for q in server.requests) == 16


@pytest.mark.slow
def test_an_unreachable_scorer_is_refused_before_anything_is_created(project):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = rl("train", "task=dataset", "task.path=train.jsonl", f"task.reward_url=http://127.0.0.1:{port}/score",
           *SMALL, "checkpoint.dir=ck", cwd=project, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    err = "".join(c for c in r.stderr if c not in "│ \n")  # the panel wraps lines
    assert "remote scorer unreachable" in r.stderr
    assert f"nothinganswersat127.0.0.1:{port}" in err and "Startthescorerfirst" in err
    assert not (project / "ck").exists()
