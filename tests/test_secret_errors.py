"""No error shows a value read from the environment (issue 47, item 2).

What is protected: `key=${oc.env:NAME}` with NAME holding a wrong value (a token where an integer
belongs: `model.hidden_size`, `trainer.seed`, `algorithm.ppo_mini_batch_size`, the three cases
the fuzzing found) printed the token in the type error. Now every error (the validation's, the
cross-field rules', the preflight's, a resume override's, and what `rl train` prints, --json
included) names the interpolation and never the value. The corpus: every key of the schema
(walked from the dataclasses), each read through `${oc.env:...}` holding a token, and through
`${oc.decode:${oc.env:...}}` (which turns the text into a number or a list, as Hydra documents
for typed values) holding wrong-typed, negative, huge and list-looking values. Each load ends in
a ConfigError (exit 2) or a config (exit 0), and the value appears in no message. Values that
fit still work.

The values are distinctive (`-37519`, not `-3`), so finding one in a message is a leak, not a
coincidence with other text.
"""

from __future__ import annotations

import json

import pytest

from engine.config.load import apply_overrides_to, load_run_config
from engine.config.owned_keys import owned_keys
from engine.config.validate import all_keys
from engine.errors import ConfigError
from engine.secret_values import forget_env_values
from tests.cli_utils import cli, flat, rl

VAR = "RL_TEST_SECRET"
TOKEN = "hunter2-SECRET-xyz"
# through oc.decode, by the key's type: a float for an int, a negative for a positive, beyond
# int64, a list where a number belongs, a number where a flag, a list or a string belongs
DECODED = {"int": ["1.73519", "-37519", "987654321987654321987654321"],
           "float": ["-37519", "[17519,-27519]", "987654321987654321987654321"],
           "bool": ["17519"], "list": ["17519", "[17519,-27519]"], "str": ["[17519,-27519]", "17519"]}


@pytest.fixture(autouse=True)
def _in_tmp(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # a dry run's relative checkpoint.dir stays out of the repository


_COMPOSED: dict = {}


@pytest.fixture
def compose_once_per_override_set(monkeypatch):
    """Hydra's compose (nearly all of a load's time) run once per distinct override set: the
    decoded values of one key share one override text, `key='${oc.decode:${oc.env:NAME}}'`, and
    compose leaves interpolations unresolved, so each value gets a fresh copy of the same
    composed node and then the whole rest of `load_run_config` (resolution reading the
    environment, validation, cross-field rules), which is where a value could leak."""
    import copy

    import hydra

    real = hydra.compose

    def compose(config_name=None, overrides=(), **kw):
        key = (config_name, tuple(overrides), tuple(sorted(kw.items())),
               str(hydra.core.global_hydra.GlobalHydra.instance().config_loader().get_sources()))
        if key not in _COMPOSED:
            _COMPOSED[key] = real(config_name=config_name, overrides=list(overrides), **kw)
        return copy.deepcopy(_COMPOSED[key])

    monkeypatch.setattr(hydra, "compose", compose)


def _groups_reading(key: str) -> tuple[list[str], str | None]:
    """Group choices under which ``key`` is read (a megatron key needs --engine megatron; critic.* ppo)."""
    line: list[str] = []
    engine = "megatron" if key in all_keys("megatron", include_all_engines=False) and \
        key not in all_keys("fsdp", include_all_engines=False) else None
    for group, readers in owned_keys().get(key, {}).items():
        if group == "engine":
            engine = readers[0]
        else:
            line.append(f"{group}={readers[0]}")
    return line, engine


def _load(override: str, key: str):
    """(config or None, error text) of composing ``override`` as `rl train` does."""
    line, engine = _groups_reading(key)
    try:
        return load_run_config([*line, override], engine=engine), ""
    except ConfigError as e:
        return None, f"{e.title} {e.message} {e}"


KEYS = sorted(all_keys(None, include_all_engines=True))


def _check_no_leak(key: str, override: str, secret: str) -> bool:
    """Compose ``override``; no message holds the secret, nor an item of a list it holds."""
    loaded, text = _load(override, key)
    parts = [secret] + (secret.strip("[]").split(",") if secret.startswith("[") else [])
    for part in parts:
        assert part not in text, f"{override} with {VAR}={secret!r} shows {part!r}: {text}"
    return loaded is not None


@pytest.mark.slow
@pytest.mark.parametrize("key", KEYS)
def test_a_token_read_from_the_environment_is_never_shown(key, monkeypatch):
    """Every key of the schema set to `${oc.env:RL_TEST_SECRET}` holding a token: a config when
    the key takes a string, else exit 2 naming the interpolation, without the token."""
    monkeypatch.setenv(VAR, TOKEN)
    _check_no_leak(key, f"{key}=${{oc.env:{VAR}}}", TOKEN)


@pytest.mark.slow
@pytest.mark.parametrize("key", KEYS)
def test_wrong_typed_values_read_from_the_environment_are_never_shown(key, monkeypatch, compose_once_per_override_set):
    """The same keys with typed values decoded from the environment: wrong types, out of range,
    beyond int64, lists; also the cross-field rules' messages (a hidden size that does not
    fit the heads, a batch that is not a multiple of the mini-batch) keep them out."""
    f = all_keys(None, include_all_engines=True)[key]
    for secret in DECODED[(f.type if isinstance(f.type, str) else f.type.__name__).replace("Optional[", "").rstrip("]")]:
        monkeypatch.setenv(VAR, secret)
        forget_env_values()
        _check_no_leak(key, f"{key}='${{oc.decode:${{oc.env:{VAR}}}}}'", secret)


@pytest.mark.parametrize("key,secret", [
    ("model.hidden_size", TOKEN), ("trainer.seed", TOKEN), ("algorithm.ppo_mini_batch_size", TOKEN),
    ("optim.lr", TOKEN), ("trainer.loggers", TOKEN), ("engine.fsdp_unit", TOKEN), ("checkpoint.overwrite", TOKEN),
    ("model.hidden_size", "1.73519"), ("model.hidden_size", "17519"), ("trainer.seed", "-37519"),
    ("algorithm.ppo_mini_batch_size", "17519"), ("optim.betas", "[17519,-27519]"),
    ("trainer.total_steps", "987654321987654321987654321"), ("task.name", "17519"),
])
def test_representative_values_are_never_shown(key, secret, monkeypatch):
    """The typed paths, fast: the token for an integer, a number, a list, a choice, a flag; a float for an int, a hidden size the heads do not divide (a
    cross-field rule), a negative seed, a mini-batch the batch is no multiple of, list items out
    of range, an integer beyond int64, a number for a choice."""
    monkeypatch.setenv(VAR, secret)
    ref = f"${{oc.env:{VAR}}}" if secret == TOKEN else f"'${{oc.decode:${{oc.env:{VAR}}}}}'"
    assert not _check_no_leak(key, f"{key}={ref}", secret)


def test_the_type_error_names_the_interpolation_and_the_fix(monkeypatch):
    """The message: the key with its interpolation, what it takes, that the value is not shown,
    and (oc.env gives text) how to read a number from the environment."""
    monkeypatch.setenv(VAR, TOKEN)
    with pytest.raises(ConfigError) as e:
        load_run_config([f"model.hidden_size=${{oc.env:{VAR}}}"])
    msg = e.value.message
    assert msg.startswith(f"`model.hidden_size=${{oc.env:{VAR}}}`: the value read from the environment does not "
                          f"fit `model.hidden_size`, which takes an integer"), msg
    assert "not shown" in msg and f"'model.hidden_size=${{oc.decode:${{oc.env:{VAR}}}}}'" in msg
    monkeypatch.setenv(VAR, "96")
    assert load_run_config([f"model.hidden_size='${{oc.decode:${{oc.env:{VAR}}}}}'",
                            "model.num_attention_heads=4"]).config.model.hidden_size == 96


def test_values_that_fit_still_work(monkeypatch):
    """A string key read from the environment resolves (and is never printed resolved)."""
    monkeypatch.setenv(VAR, TOKEN)
    loaded = load_run_config([f"trainer.project=${{oc.env:{VAR}}}"])
    assert loaded.config.trainer.project == TOKEN
    r = cli("train", "--dry-run", "--json", f"trainer.project=${{oc.env:{VAR}}}")
    assert r.exit_code == 0, r.stderr
    assert TOKEN not in r.stdout + r.stderr
    assert json.loads(r.stdout)["config"]["trainer"]["project"] == f"${{oc.env:{VAR}}}"


def test_resume_overrides_never_show_it(monkeypatch):
    """`rl resume DIR trainer.seed=${oc.env:...}` (apply_overrides_to) refuses without the value."""
    monkeypatch.setenv(VAR, TOKEN)
    cfg = load_run_config([]).config
    with pytest.raises(ConfigError) as e:
        apply_overrides_to(cfg, [f"trainer.seed=${{oc.env:{VAR}}}"])
    assert TOKEN not in str(e.value) and f"${{oc.env:{VAR}}}" in e.value.message


@pytest.mark.parametrize("override", [
    "model.hidden_size=${oc.env:RL_TEST_SECRET}", "trainer.seed=${oc.env:RL_TEST_SECRET}",
    "algorithm.ppo_mini_batch_size=${oc.env:RL_TEST_SECRET}",
    "model.path=${oc.env:RL_TEST_SECRET}",            # the preflight's "does not exist" names the path
    "task.reward_fn=${oc.env:RL_TEST_SECRET}",        # a reward function on a built-in task
    "checkpoint.dir=/proc/${oc.env:RL_TEST_SECRET}",  # a run directory that cannot be made
])
@pytest.mark.parametrize("json_out", [False, True])
def test_rl_train_dry_run_never_prints_it(override, json_out, monkeypatch):
    """What `rl train --dry-run` prints (the error panel, --json's error document, the preflight
    table) holds the interpolation, not the value: exit 2."""
    monkeypatch.setenv(VAR, TOKEN)
    r = cli("train", "--dry-run", *(["--json"] if json_out else []), override)
    assert r.exit_code == 2, (r.stdout, r.stderr)
    out = r.stdout + r.stderr
    assert TOKEN not in out, out
    assert f"${{oc.env:{VAR}}}" in flat(out) or VAR in out
    if json_out:  # one JSON document with "error": alone, or beside the config and the preflight that failed
        doc = json.loads(r.stdout)
        assert doc["error"]["exit_code"] == 2 and ("preflight" not in doc or doc["preflight"]["ok"] is False), doc


@pytest.mark.slow
def test_real_rl_processes_never_print_it(tmp_path):
    """The same through real `rl` processes: `rl train` (type error) and `rl train --dry-run`
    (a model path that does not exist), exit 2, the value in neither stream."""
    env = {VAR: TOKEN}
    for args in (["train", f"trainer.seed=${{oc.env:{VAR}}}", f"checkpoint.dir={tmp_path / 'a'}"],
                 ["train", "--dry-run", f"model.path=${{oc.env:{VAR}}}"]):
        r = rl(*args, env=env, cwd=tmp_path, timeout=300)
        assert r.returncode == 2, r.stderr[-2000:]
        assert TOKEN not in r.stdout + r.stderr, r.stderr[-2000:]
        assert VAR in r.stderr


def test_rl_eval_overrides_never_show_it(monkeypatch):
    """`rl eval PATH eval.n=${oc.env:...}` (eval_config) refuses naming the interpolation."""
    from engine.evaluate.config import eval_config

    monkeypatch.setenv(VAR, TOKEN)
    with pytest.raises(ConfigError) as e:
        eval_config([f"eval.n=${{oc.env:{VAR}}}"])
    assert TOKEN not in str(e.value) and e.value.message.startswith(f"`eval.n=${{oc.env:{VAR}}}`: the value read")


def test_the_net_hides_values_wherever_they_stand(monkeypatch):
    """redact: a long value anywhere (inside a path too), a short one only where it stands alone
    (`-3` in `got -3.`, not the 3 of `13` or `1e-3`), a list's items one by one."""
    from engine.secret_values import redact, remember_env_values

    monkeypatch.setenv("RL_TEST_A", TOKEN)
    monkeypatch.setenv("RL_TEST_B", "-3")
    monkeypatch.setenv("RL_TEST_C", "[17519, abcdefgh]")
    remember_env_values({"x": "${oc.env:RL_TEST_A}", "y": ["${oc.env:RL_TEST_B}"], "z": "${oc.decode:${oc.env:RL_TEST_C}}"})
    assert redact(f"/data/{TOKEN}/m does not exist") == "/data/${oc.env:RL_TEST_A}/m does not exist"
    assert redact("got -3. step 13, lr 1e-3") == "got ${oc.env:RL_TEST_B}. step 13, lr 1e-3"
    assert redact("unknown logger 17519 or abcdefgh") == "unknown logger ${oc.env:RL_TEST_C} or ${oc.env:RL_TEST_C}"
    assert ConfigError(f"bad {TOKEN}").message == "bad ${oc.env:RL_TEST_A}"
