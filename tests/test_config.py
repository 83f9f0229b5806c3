"""The config contract: strict validation with actionable messages, exit 2 without a
traceback, and YAML/docs that cannot drift from the schema."""

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from engine.config.load import load_run_config
from engine.errors import ConfigError
from rlcli.main import app

runner = CliRunner()


def run_cli(*args):
    return runner.invoke(app, list(args))


@pytest.mark.parametrize("engine", ["fsdp", "megatron"])
def test_removed_key_names_replacement_and_exits_2(engine):
    """A removed key fails at parse time, names its replacement and why, exit 2, no traceback."""
    r = run_cli("train", "--engine", engine, "engine.grad_offload=true")
    assert r.exit_code == 2
    text = r.output
    assert "engine.grad_offload" in text and "engine.param_offload" in text and "removed" in text
    assert "Traceback" not in text


def test_typo_gets_did_you_mean():
    r = run_cli("train", "trainer.total_stpes=3")
    assert r.exit_code == 2
    assert "did you mean" in r.output.lower() and "trainer.total_steps" in r.output
    assert "Traceback" not in r.output


def test_wrong_type_and_range_name_key_value_and_allowed():
    with pytest.raises(ConfigError, match=r"trainer\.nprocs.*integer.*'two'"):
        load_run_config(["trainer.nprocs=two"])
    with pytest.raises(ConfigError, match=r"rollout\.top_p.*<= 1"):
        load_run_config(["rollout.top_p=1.5"])
    with pytest.raises(ConfigError, match=r"loss_agg_mode.*token-mean"):
        load_run_config(["algorithm.loss_agg_mode=tokenmean"])


def test_unknown_group_option_lists_options():
    with pytest.raises(ConfigError, match=r"task=ech.*Did you mean `echo`.*Options:"):
        load_run_config(["task=ech"])


def test_a_group_option_that_is_a_key_value_names_the_key():
    """`algorithm=gspo` (verl and TRL users think of GSPO as an algorithm): GSPO is rl's `algorithm.loss`,
    which goes with any estimator preset; the error says so instead of 'did you mean grpo'."""
    with pytest.raises(ConfigError, match=r"`gspo` is a value of `algorithm.loss`: set `algorithm.loss=gspo` .*"
                                          r"`algorithm=grpo algorithm.loss=gspo`") as e:
        load_run_config(["algorithm=gspo"])
    assert "Did you mean" not in str(e.value)


def test_verl_and_trl_names_name_the_rl_key():
    """A verl override or a TRL GRPOConfig field names rl's key (the nearest spelling would be wrong:
    `algorithm.adv_estimator` is closest to `algorithm.gamma`), with the value when it means the same
    in rl, and without it when it does not (TRL's loss_type=dapo is rl's token-mean)."""
    with pytest.raises(ConfigError, match=r"`actor_rollout_ref.rollout.n` is verl's config name; in rl it is "
                                          r"`algorithm.rollout_n`. Set `algorithm.rollout_n=4` instead."):
        load_run_config(["actor_rollout_ref.rollout.n=4"])
    with pytest.raises(ConfigError, match=r"the `algorithm` group .* Set `algorithm=dapo` instead"):
        load_run_config(["algorithm.adv_estimator=dapo"])
    with pytest.raises(ConfigError, match=r"TRL's GRPOConfig name; in rl it is `algorithm.loss_agg_mode` "
                                          r"\(TRL's dapo is token-mean.*Set `algorithm.loss_agg_mode` instead") as e:
        load_run_config(["loss_type=dapo"])
    assert "=dapo" not in str(e.value)


def test_every_translation_points_at_an_rl_key_and_shadows_none():
    """A foreign name that were also an rl key would refuse a valid override; a target that is not
    an rl key or group would send the user to another error."""
    from engine.config.foreign_keys import FOREIGN_KEYS
    from engine.config.schema import CONFIG_GROUPS
    from engine.config.validate import all_keys

    keys = all_keys(None, include_all_engines=True)
    assert not set(FOREIGN_KEYS) & set(keys)
    assert all(k.rl in keys or k.rl in CONFIG_GROUPS for k in FOREIGN_KEYS.values() if k.rl), \
        [n for n, k in FOREIGN_KEYS.items() if k.rl and k.rl not in keys and k.rl not in CONFIG_GROUPS]


def test_a_verl_config_file_gets_every_translation_at_once(tmp_path):
    """`rl train --config` on a verl config: one error that translates each name it uses."""
    f = tmp_path / "verl.yaml"
    f.write_text("data:\n  max_response_length: 1024\n  train_batch_size: 256\nactor_rollout_ref:\n"
                 "  actor:\n    optim:\n      lr: 1.0e-6\n  rollout:\n    n: 5\n    name: vllm\n"
                 "trainer:\n  total_epochs: 15\n")
    with pytest.raises(ConfigError) as e:
        load_run_config([], config_file=f)
    said = str(e.value)
    for part in ("This config uses verl's names", "`data.max_response_length` -> `rollout.max_new_tokens: 1024`",
                 "`actor_rollout_ref.actor.optim.lr` -> `optim.lr: 1e-06`",
                 "`actor_rollout_ref.rollout.n` -> `algorithm.rollout_n: 5`",
                 "`actor_rollout_ref.rollout.name` -> `rollout: vllm`", "`trainer.total_epochs` -> `trainer.total_steps` ("):
        assert part in said, said


def test_engine_specific_key_refused_on_other_engine():
    """tensor_model_parallel_size is a megatron key: under fsdp it is refused with a pointer."""
    with pytest.raises(ConfigError, match=r"read only with engine=megatron, and this run's engine is `fsdp`.*"
                                          r"choose `--engine megatron`"):
        load_run_config(["engine.tensor_model_parallel_size=2"])
    cfg = load_run_config(["engine.tensor_model_parallel_size=2", "trainer.nprocs=2"], engine="megatron").config
    assert cfg.engine.tensor_model_parallel_size == 2


def test_overrides_apply_and_changes_are_reported():
    loaded = load_run_config(["trainer.total_steps=7", "task=add", "optim.betas=[0.8,0.9]"])
    assert loaded.config.trainer.total_steps == 7
    assert loaded.config.task.name == "add"
    assert loaded.config.optim.betas == [0.8, 0.9]
    assert loaded.changed["trainer.total_steps"] == (40, 7)


def test_cross_field_rule():
    with pytest.raises(ConfigError, match="multiple of"):
        load_run_config(["data.train_batch_size=10", "algorithm.ppo_mini_batch_size=4"])
    with pytest.raises(ConfigError, match="task.path"):
        load_run_config(["task=jsonl"])


def test_dry_run_prints_plan_and_json():
    r = run_cli("train", "--dry-run", "--json", "trainer.total_steps=3")
    assert r.exit_code == 0, r.output
    import json
    data = json.loads(r.stdout)
    assert data["config"]["trainer"]["total_steps"] == 3


def test_generated_files_match_schema():
    """configs/rl.yaml, configs/engine/*.yaml and docs/config-reference.md are generated from
    the dataclasses; this fails when someone edits one without the other."""
    r = subprocess.run([sys.executable, "-m", "engine.config.generate", "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("overrides,engine,named", [
    (["engine=megatron"], "fsdp", ("--engine fsdp", "engine=megatron")),
    (["task=sort", "task=add"], None, ("task=sort", "task=add")),
    (["algorithm=grpo", "algorithm=ppo"], None, ("algorithm=grpo", "algorithm=ppo")),
])
def test_a_config_group_chosen_twice_differently_is_refused_naming_both(overrides, engine, named):
    """`--engine fsdp engine=megatron` ran fsdp silently and overrides.yaml recorded one of the two
    (issue 42): the same group chosen twice with different values is an error naming both."""
    from engine.config.load import load_run_config
    from engine.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_run_config(overrides, engine=engine)
    assert all(f"`{n}`" in e.value.message for n in named), e.value.message
    assert load_run_config(["engine=fsdp"], engine="fsdp").config.engine.name == "fsdp"  # the same twice is fine


def test_dataset_keys_with_a_built_in_task_are_refused():
    """`task.path=prompts.jsonl` without `task=dataset` trained the built-in echo task and ignored the
    file (issue 42): a dataset-only key given to a built-in task is an error saying which task to pick."""
    from engine.config.load import load_run_config
    from engine.errors import ConfigError

    for o in ("task.path=prompts.jsonl", "task.prompt_key=question", "task.val_split=test"):
        with pytest.raises(ConfigError, match="task=dataset") as e:
            load_run_config([o])
        assert f"`{o}`" in e.value.message
    with pytest.raises(ConfigError, match="built-in `sort`"):
        load_run_config(["task=sort", "task.path=prompts.jsonl"])


@pytest.mark.parametrize("override", ["optim.lr=1e-3,5e-3", "optim.lr=range(1,3)", "trainer.seed=choice(0,1)"])
def test_hydra_sweep_syntax_says_what_rl_supports(override):
    """Hydra answers a sweep with "add --multirun", which rl does not have (issue 42): the error says
    that rl runs one job, how to run one per value, and how to write a list or a quoted string."""
    from engine.config.load import load_run_config
    from engine.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_run_config([override])
    msg = e.value.message
    assert "Hydra sweep" in msg and "one run per value" in msg and "--multirun" not in msg, msg
    assert load_run_config(["optim.betas=[0.9,0.999]"]).config.optim.betas == [0.9, 0.999]
