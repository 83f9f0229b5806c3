"""Overrides that the chosen engine, rollout or algorithm would ignore are errors (issue 42, item 3).

What is protected: a key that only some options of a group read (declared once in the schema,
``metadata["only_for"]``) set while another option is chosen is refused, exit 2, naming the key,
the option chosen and the option that reads it (`--engine fsdp engine.compile=...` on megatron,
`rollout.gpu_memory_utilization` with rollout=torch, `critic.*` or `algorithm.lam` without
algorithm=ppo); the same key with an option that reads it loads. Only what the user sets counts:
the defaults and the groups' presets (which hold every key) never trip it, and neither does a
run's own config.yaml (every key, at what its groups give). `rl resume` overrides get the same
check. Every declared rule is checked against the code that reads the key, by source text.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import asdict

import pytest

from engine.config.load import apply_overrides_to, group_options, load_run_config
from engine.config.owned_keys import chosen_option, owned_keys
from engine.errors import ConfigError
from tests.cli_utils import cli, flat

GROUPS_CHECKED = ("engine", "rollout", "algorithm")


def _value(key: str) -> str:
    """A valid value for ``key`` (its default): even the default counts when the user sets it."""
    from engine.config.load import flatten
    from engine.config.schema import RunConfig

    v = flatten(asdict(RunConfig()))[key] if not key.startswith("engine.") else {
        "engine.fp8": False, "engine.compile": False, "engine.fused_kernels": False,
        "engine.fused_lm_head": False}[key]
    if isinstance(v, bool):
        return str(v).lower()
    return '""' if v == "" else str(v)


def _options(group: str) -> list[str]:
    """A config group's options, or a choice field's choices (``trainer.mode``)."""
    if "." not in group:
        return group_options(group)
    from dataclasses import fields

    from engine.config.schema import section_types

    section, key = group.split(".")
    return list(next(f for f in fields(section_types()[section]) if f.name == key).metadata["choices"])


def _cases():
    for key, rule in sorted(owned_keys().items()):
        for group, readers in rule.items():
            for option in _options(group):
                yield key, group, option, option in readers


def _choose(group: str, option: str) -> tuple[list[str], str | None]:
    return ([], option) if group == "engine" else ([f"{group}={option}"], None)


def test_the_declared_rules_are_the_expected_ones():
    """The schema's declarations, spelled out: a change to them is a decision, seen here."""
    assert owned_keys() == {
        "engine.compile": {"engine": ("fsdp",)},
        "engine.fused_kernels": {"engine": ("fsdp",)},
        "engine.fused_lm_head": {"engine": ("fsdp",)},
        "engine.fp8": {"engine": ("megatron",)},
        "rollout.decode_lanes": {"rollout": ("torch",)},
        "rollout.cuda_graphs": {"rollout": ("torch",)},
        "rollout.gpu_memory_utilization": {"rollout": ("vllm",)},
        "rollout.verify_sync": {"rollout": ("vllm",)},
        "algorithm.norm_adv_by_std": {"algorithm": ("grpo", "dapo")},
        "algorithm.gamma": {"algorithm": ("reinforce_pp", "ppo")},
        "algorithm.lam": {"algorithm": ("ppo",)},
        "algorithm.whiten_advantages": {"algorithm": ("ppo",)},
        **{f"critic.{k}": {"algorithm": ("ppo",)} for k in
           ("model_path", "lr", "weight_decay", "grad_clip", "cliprange_value", "warmup_steps")},
        "trainer.max_staleness": {"trainer.mode": ("async",)},
        "trainer.stream_chunk_groups": {"trainer.mode": ("streamed",)},
    }


@pytest.mark.parametrize("key,group,option,reads", list(_cases()))
def test_each_rule_with_a_real_load(key, group, option, reads):
    """Every declared key with every option of its group: loads where the option reads it, else
    the error names the override, the option chosen and the option(s) that read the key."""
    line, engine = _choose(group, option)
    override = f"{key}={_value(key)}"
    if reads:
        cfg = load_run_config([*line, override], engine=engine).config
        assert chosen_option(cfg, group) == option
        return
    with pytest.raises(ConfigError) as e:
        load_run_config([*line, override], engine=engine)
    msg = e.value.message
    readers = owned_keys()[key][group]
    assert e.value.title == "override has no effect"
    assert msg.startswith(f"`{override}` has no effect"), msg
    assert f"this run's {group} is `{option}`" in msg, msg
    fix = "`--engine {}`" if group == "engine" else f"`{group}={{}}`"
    assert all(fix.format(r) in msg for r in readers), msg
    assert f"drop `{key}`" in msg, msg


@pytest.mark.parametrize("engine,rollout,algorithm", list(itertools.product(
    group_options("engine"), group_options("rollout"), group_options("algorithm"))))
def test_defaults_and_presets_never_trip_it(engine, rollout, algorithm):
    """Every combination of engine, rollout and algorithm with no key set loads: the presets
    (ppo.yaml's gamma and lam, dr_grpo.yaml's norm_adv_by_std) are not the user's overrides."""
    cfg = load_run_config([f"rollout={rollout}", f"algorithm={algorithm}"], engine=engine).config
    assert (cfg.engine.name, cfg.rollout.name, cfg.algorithm.name) == (engine, rollout, algorithm)


@pytest.mark.parametrize("engine,rollout,algorithm", [("fsdp", "torch", "grpo"), ("megatron", "vllm", "ppo"),
                                                      ("fsdp", "vllm", "dr_grpo"), ("megatron", "torch", "rloo")])
def test_a_runs_own_config_yaml_does_not_trip_it(tmp_path, engine, rollout, algorithm):
    """config.yaml as a run writes it (RunDir.create: every key) composes back under --config,
    to the same config, although it holds every key the run's options ignore."""
    from engine.trainer.run_dir import RunDir

    line = [f"rollout={rollout}", f"algorithm={algorithm}", "optim.lr=1e-3"]
    loaded = load_run_config(line, engine=engine)
    RunDir(tmp_path).create(loaded.config, loaded.overrides, overwrite=False, env_refs=loaded.env_refs)
    again = load_run_config(config_file=str(tmp_path / "config.yaml"))
    assert asdict(again.config) == asdict(loaded.config)


def test_a_config_file_setting_an_ignored_key_is_refused_naming_the_file(tmp_path):
    """A file's value away from what its groups give, for a key the chosen option ignores: the
    override's error, naming the file. The same value under the option that reads it loads."""
    f = tmp_path / "c.yaml"
    f.write_text("rollout:\n  gpu_memory_utilization: 0.7\n")
    with pytest.raises(ConfigError) as e:
        load_run_config(config_file=str(f))
    assert e.value.message.startswith(f"In --config {f}: `rollout.gpu_memory_utilization=0.7` has no effect")
    assert "this run's rollout is `torch`" in e.value.message
    assert load_run_config(["rollout=vllm"], config_file=str(f)).config.rollout.gpu_memory_utilization == 0.7
    f.write_text("algorithm: ppo\ncritic:\n  lr: 0.05\n")
    assert load_run_config(config_file=str(f)).config.critic.lr == 0.05


def test_resume_overrides_get_the_same_check():
    """`rl resume KEY=VALUE` (apply_overrides_to) refuses a key the run's choices ignore."""
    cfg = load_run_config([]).config
    with pytest.raises(ConfigError, match=r"`critic.lr=0.1` has no effect.*this run's algorithm is `grpo`"):
        apply_overrides_to(cfg, ["critic.lr=0.1"])
    ppo = load_run_config(["algorithm=ppo"]).config
    assert apply_overrides_to(ppo, ["critic.lr=0.1"]).critic.lr == 0.1


def test_cli_exit_2_names_both(tmp_path):
    """`rl train --engine megatron engine.compile=true` and `rl train rollout.gpu_memory_utilization=0.6`:
    exit 2, one paragraph naming the key, the choice and the fix; no traceback."""
    for args, want in ((["--engine", "megatron", "engine.compile=true"],
                        "`engine.compile=true` has no effect: `engine.compile` is read only with engine=fsdp, and "
                        "this run's engine is `megatron`"),
                       (["rollout.gpu_memory_utilization=0.6"], "this run's rollout is `torch`, which ignores it. "
                                                                "To use it choose `rollout=vllm`"),
                       (["engine.tensor_model_parallel_size=2"], "read only with engine=megatron, and this run's "
                                                                 "engine is `fsdp`")):
        r = cli("train", "--dry-run", f"checkpoint.dir={tmp_path / 'run'}", *args)
        assert r.exit_code == 2, (args, r.stdout, r.stderr)
        assert want in flat(r.stderr), flat(r.stderr)
        assert "Traceback" not in r.stderr


def test_the_code_that_reads_each_key_belongs_to_its_option():
    """The declarations agree with the readers: the torch sampler never reads the vLLM-only keys
    and the vLLM sampler never reads decode_lanes; lam and whiten_advantages are read only in
    the PPO branch of compute_advantages, gamma only in the REINFORCE++ and PPO branches, and
    norm_adv_by_std in neither of those."""
    from pathlib import Path

    rollout = Path(__file__).resolve().parents[1] / "engine" / "rollout"
    torch_src, vllm_src = (rollout / "torch_sampler.py").read_text(), (rollout / "vllm_sampler.py").read_text()
    assert "gpu_memory_utilization" not in torch_src and "verify_sync" not in torch_src
    assert "gpu_memory_utilization" in vllm_src and "verify_sync" in vllm_src
    assert "decode_lanes" not in vllm_src and "decode_lanes" in torch_src
    from engine.algorithms.estimators import compute_advantages

    src = inspect.getsource(compute_advantages)
    rpp = src[src.index('if name == "reinforce_pp"'):src.index('if name == "ppo"')]
    ppo = src[src.index('if name == "ppo"'):src.index('if name == "rloo"')]
    rest = src.replace(rpp, "").replace(ppo, "")
    assert "cfg.lam" in ppo and "cfg.whiten_advantages" in ppo and "cfg.gamma" in ppo and "cfg.gamma" in rpp
    assert not any(f"cfg.{k}" in rest for k in ("lam", "whiten_advantages", "gamma"))
    assert "cfg.norm_adv_by_std" in rest and "cfg.norm_adv_by_std" not in ppo + rpp
    # max_staleness is read where the mode says how far ahead to sample, for async alone
    from engine.config.resolved import versions_ahead

    assert '{"sync": 0, "one_step_off": 1, "streamed": 0}.get(t.mode, t.max_staleness)' in \
        inspect.getsource(versions_ahead)
    # stream_chunk_groups: read by stream_chunk_groups(), which only the streamed step calls
    from engine.config.resolved import stream_chunk_groups

    assert "cfg.trainer.stream_chunk_groups" in inspect.getsource(stream_chunk_groups)
    callers = [p for p in (Path(__file__).resolve().parents[1] / "engine").rglob("*.py")
               if "stream_chunk_groups(" in p.read_text()]
    assert sorted(p.name for p in callers) == ["resolved.py", "streamed_update.py"]
