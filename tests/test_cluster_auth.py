"""Joining a Ray cluster that has token authentication on (issue 47, item 5).

Ray's documented way: every node and driver runs with RAY_AUTH_MODE=token and the same token,
from RAY_AUTH_TOKEN, the file named by RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token. Here a real
`ray start --head` on loopback with auth on (tests/ray_procs.LoopbackHead, its own temp dir;
runs anywhere, no root): the two-host version with network namespaces is in
tests/test_cluster_netns.py (root only). HOME points at an empty directory for every command,
so no developer's ~/.ray/auth_token takes part.

Protects: a run joins with the token passed as a file (RAY_AUTH_TOKEN_PATH) and trains; the
settings Ray treats as fatal without a word (token mode with no token anywhere; a token path
naming no file) end with exit 2 and one paragraph naming the fix, not a traceback or a silent
exit 1; the message never shows the token."""

from __future__ import annotations

import secrets
import subprocess

import pytest

from engine.errors import UserError
from engine.trainer.ray_auth import auth_error, check_token_settings, gcs_address, token_source
from tests.ray_procs import LoopbackHead, child_env, metrics_rows, plain, rl_cmd

TINY = ("trainer.total_steps=1", "data.train_batch_size=2", "algorithm.rollout_n=2", "checkpoint.save_final=false")
ADDR = "10.0.0.1:6379"


# ---- the messages and settings (no Ray) ---------------------------------------------------------
def test_token_source_follows_rays_order(tmp_path, monkeypatch):
    """RAY_AUTH_TOKEN, then RAY_AUTH_TOKEN_PATH, then ~/.ray/auth_token, as Ray reads them."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert token_source({}) == ""
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("t")
    assert token_source({}) == "~/.ray/auth_token"
    assert token_source({"RAY_AUTH_TOKEN_PATH": "/x"}).startswith("RAY_AUTH_TOKEN_PATH")
    assert token_source({"RAY_AUTH_TOKEN": "t", "RAY_AUTH_TOKEN_PATH": "/x"}) == "RAY_AUTH_TOKEN"


def test_refusal_says_what_the_driver_sent_and_never_the_token(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    secret = "s3cr3t-token-value"
    off = auth_error(ADDR, {"RAY_AUTH_TOKEN": secret}).message
    assert ADDR in off and "sent no token" in off and "RAY_AUTH_MODE is unset" in off
    assert "available from RAY_AUTH_TOKEN, but unused" in off and "RAY_AUTH_MODE=token" in off
    wrong = auth_error(ADDR, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secret}).message
    assert "rejected the token this driver sent (from RAY_AUTH_TOKEN)" in wrong
    none = auth_error(ADDR, {"RAY_AUTH_MODE": "token"}).message
    assert none.startswith(f"Cannot join the Ray cluster at {ADDR}") and "has no token" in none
    for m in (off, wrong, none):
        assert secret not in m and "RAY_AUTH_TOKEN" in m and "ray get-auth-token" in m


def test_settings_ray_would_end_the_process_on_are_refused(tmp_path, monkeypatch):
    """Token mode with no token anywhere, and RAY_AUTH_TOKEN_PATH naming a missing or empty
    file: Ray's C++ client ends the process (exit 1, no message) on these."""
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(UserError, match="has no token"):
        check_token_settings(ADDR, {"RAY_AUTH_MODE": "token"})
    with pytest.raises(UserError, match="cannot be read"):
        check_token_settings(ADDR, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "none")})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(UserError, match="is empty"):
        check_token_settings(ADDR, {"RAY_AUTH_TOKEN_PATH": str(tmp_path / "empty")})
    (tmp_path / "tok").write_text("t")
    check_token_settings(ADDR, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "tok")})
    check_token_settings(ADDR, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "t"})
    check_token_settings(ADDR, {})  # auth off: nothing to check


def test_gcs_address_of_what_a_probe_can_check():
    assert gcs_address("10.0.0.1:6379") == "10.0.0.1:6379"
    assert gcs_address("ray://h:10001") == "" and gcs_address("h") == ""


# ---- a real cluster with auth on ------------------------------------------------------------------
@pytest.fixture(scope="module")
def auth_head(tmp_path_factory):
    token = secrets.token_hex(16)
    home = tmp_path_factory.mktemp("home")  # no ~/.ray/auth_token
    env = child_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
                    RAY_ADDRESS=None, HOME=str(home))
    head = LoopbackHead("rla-", 2, env)
    try:
        assert head.started.returncode == 0, head.started.stdout + head.started.stderr
        yield head, token, home
    finally:
        head.stop()


def _train(head, home, run_dir, **auth) -> subprocess.CompletedProcess:
    env = child_env(RAY_TMPDIR=str(head.tmp), RAY_ADDRESS=head.address, HOME=str(home), RAY_AUTH_MODE=None,
                    RAY_AUTH_TOKEN=None, RAY_AUTH_TOKEN_PATH=None)
    env.update({k: v for k, v in auth.items() if v is not None})
    return subprocess.run(rl_cmd("train", *TINY, f"checkpoint.dir={run_dir}"), env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_run_joins_an_authenticated_cluster_with_the_token_file(auth_head, tmp_path):
    head, token, home = auth_head
    (tmp_path / "token").write_text(token)
    r = _train(head, home, tmp_path / "ck", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(tmp_path / "token"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["step"] for x in metrics_rows(tmp_path / "ck")] == [1]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["token mode, no token", "token path names no file"])
def test_fatal_token_settings_are_exit_2_not_a_crash(auth_head, tmp_path, case):
    head, token, home = auth_head
    auth = {"RAY_AUTH_MODE": "token"}
    if case == "token path names no file":
        auth["RAY_AUTH_TOKEN_PATH"] = str(tmp_path / "missing")
    r = _train(head, home, tmp_path / "ck", **auth)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
    err = plain(r.stderr)
    assert "Traceback" not in err and "RAY_AUTH_TOKEN" in err, err
    assert ("has no token" in err and head.address in err) if case == "token mode, no token" else "cannot be read" in err
    assert not metrics_rows(tmp_path / "ck")


@pytest.mark.slow
def test_driver_without_the_token_is_refused_on_loopback(auth_head, tmp_path):
    """The same refusal as the two-host test's, where network namespaces cannot be made."""
    head, token, home = auth_head
    r = _train(head, home, tmp_path / "ck", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="wrong-" + token[:6])
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
    err = plain(r.stderr)
    assert "rejected the token" in err and head.address in err and "InvalidAuthToken" not in err, err
    assert "wrong-" + token[:6] not in r.stdout + r.stderr and token not in r.stdout + r.stderr
