"""Generated overrides through `rl train --dry-run` and `rl resume --dry-run` (issue 19, "done
when"): random keys (schema keys, near misses, unicode), values of every type (huge and
non-finite numbers, lists, mappings, unicode, empty strings), Hydra's `+`/`++`/`~` prefixes
and interpolations. Every one ends in exit 0 or exit 2: no traceback, no escaped exception, no hang.

The bulk runs in process (typer's CliRunner on rlcli.main.app) to stay fast; a handful of the
nastiest go through real `rl` subprocesses. Resume fuzzing uses one small real checkpoint made
once per module."""

from __future__ import annotations

import signal
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.cli_utils import cli, rl

pytestmark = pytest.mark.slow
EXAMPLES = 150   # per command: 300 generated overrides in all (issue 19: at least 300)
HANG_S = 120     # one dry run taking this long counts as a hang (a guard, not a speed target)


def _schema_keys() -> list[str]:
    from engine.config.schema import CONFIG_GROUPS
    from engine.config.validate import all_keys

    return sorted(all_keys(None, include_all_engines=True)) + list(CONFIG_GROUPS)


KEYS = _schema_keys()
ODD_VALUES = ["", "nan", "-nan", "inf", "-inf", ".inf", "1e999", "-1e999", "NaN", "0x1F", "1_000", "-0", "1e-400",
              "true", "false", "null", "~", "[]", "[a,b]", "[0.9]", "[1,[2]]", "{}", "{a: 1}", "''", '""', "'",
              "\\", "=", "==", ",", "a,b", "${oc.env:RL_FUZZ_UNSET}", "${nonexistent.key}", "${hydra:runtime.cwd}",
              "${trainer.seed}", "${oc.env:HOME}", "${", "${}", "$${x}", "${oc.decode:'[1,2]'}", "${oc.env:}",
              "${unknown_resolver:x}", "${trainer}", "/proc/x", "/dev/null", "/etc/passwd/x", ".", "..",
              "99999999999999999999999", "-99999999999999999999999", str(2**63), str(-2**63 - 1), str(2**64),
              "4294967296", "ｔｒｕｅ", "１２", "💥", "\u202e", "a" * 300, "fsdp", "megatron", "vllm"]

values = st.one_of(
    st.sampled_from(ODD_VALUES),
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=24),
    st.lists(st.one_of(st.integers(-5, 5).map(str), st.sampled_from(["nan", "inf", "a", "0.9", ""])),
             max_size=4).map(lambda xs: "[" + ",".join(xs) + "]"),
)
keys = st.one_of(
    st.sampled_from(KEYS),
    st.sampled_from(KEYS).map(lambda k: k + "x"),
    st.sampled_from(KEYS).map(lambda k: k.rsplit(".", 1)[0] + ".nope"),
    st.from_regex(r"[a-z_]{1,8}(\.[a-z_]{1,8}){0,3}", fullmatch=True),
    st.text(min_size=0, max_size=12),
)
def _typed_values(key: str):
    """Values of the key's own type, near and beyond its limits: these reach the preflight."""
    from engine.config.validate import all_keys

    f = all_keys(None, include_all_engines=True).get(key)
    if f is None:  # a config group
        from engine.config.load import group_options

        return st.sampled_from(group_options(key) + ["nope"])
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
    meta = f.metadata
    if "choices" in meta:
        return st.sampled_from([str(c) for c in meta["choices"]])
    if "int" in t:
        return st.one_of(st.integers(0, 64), st.integers(-3, 2**40)).map(str)
    if "float" in t:
        return st.one_of(st.floats(0, 1), st.floats(-10, 1e6, allow_nan=False)).map(repr)
    if "bool" in t:
        return st.sampled_from(["true", "false"])
    if "list" in t:
        return st.lists(st.floats(0, 1.2, allow_nan=False).map(repr), max_size=3).map(
            lambda xs: "[" + ",".join(xs) + "]")
    return st.one_of(st.text(max_size=12), st.sampled_from(["", "x", "/tmp", "mod:fn", "os:system"]))


typed = st.sampled_from(KEYS).flatmap(lambda k: _typed_values(k).map(lambda v: f"{k}={v}"))
overrides = st.one_of(
    typed,
    typed,
    st.tuples(st.sampled_from(["", "", "", "+", "++", "~"]), keys, values).map(
        lambda t: f"{t[0]}{t[1]}" if t[0] == "~" and not t[2] else f"{t[0]}{t[1]}={t[2]}"),
    st.text(max_size=30),
)


@contextmanager
def hang_guard(what: str):
    def on_alarm(signum, frame):
        raise TimeoutError(f"{what} took over {HANG_S}s (a hang)")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(HANG_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def assert_clean(r, args) -> None:
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        import traceback

        tb = "".join(traceback.format_exception(r.exception))
        raise AssertionError(f"`rl {' '.join(map(repr, args))}` raised:\n{tb}")
    assert r.exit_code in (0, 2), (args, r.exit_code, r.stdout[-2000:], r.stderr[-2000:])
    assert "Traceback" not in r.stdout + r.stderr, (args, r.stderr[-3000:])


@pytest.fixture(scope="module")
def checkpoint(small_run) -> Path:
    """One small real run with its checkpoints: the suite's shared one (tests/conftest.py), which a
    dry run must leave as it is."""
    return small_run


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RL_FUZZ_UNSET", raising=False)
    return tmp_path


SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@SETTINGS
@given(override=overrides)
def test_rl_train_dry_run_survives_any_override(override, in_tmp):
    args = ["train", "--dry-run", "--json", override]
    with hang_guard(f"rl {' '.join(args)}"):
        r = cli(*args)
    assert_clean(r, args)


@SETTINGS
@given(override=overrides)
def test_rl_resume_dry_run_survives_any_override(override, checkpoint, in_tmp):
    before = sorted(p.relative_to(checkpoint) for p in checkpoint.rglob("*"))
    args = ["resume", str(checkpoint), "--dry-run", override]
    with hang_guard(f"rl {' '.join(args)}"):
        r = cli(*args)
    assert_clean(r, args)
    assert sorted(p.relative_to(checkpoint) for p in checkpoint.rglob("*")) == before  # a dry run changes nothing


NASTY = ["", "++trainer.seed=1", "trainer.total_steps=${oc.env:RL_FUZZ_UNSET}", "optim.betas=[a,b]",
         "тренер.шаги=1", "checkpoint.dir=/proc/x"]


@pytest.mark.parametrize("override", NASTY)
def test_real_rl_train_dry_run_nasty_overrides(override, tmp_path):
    r = rl("train", "--dry-run", override, cwd=tmp_path, timeout=HANG_S * 3)
    assert r.returncode in (0, 2) and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("override", ["", "trainer.total_steps=${nonexistent.key}"])
def test_real_rl_resume_dry_run_nasty_overrides(override, checkpoint, tmp_path):
    r = rl("resume", str(checkpoint), "--dry-run", override, cwd=tmp_path, timeout=HANG_S * 3)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
