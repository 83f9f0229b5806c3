"""Shell completion for `rl`: what TAB offers in real bash, zsh and fish, and that it is fast.

Real shells are driven through tmux (send-keys / capture-pane) with the checked-in scripts
from completions/ loaded; `rl` on their PATH is this checkout's console script. Shell tests
skip, naming the missing binary, when bash/zsh/fish/tmux is absent; CI installs them with
`apt-get install -y zsh fish tmux`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from rlcli import completion_keys as ck
from rlcli import completion_scripts

REPO = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "ray", "hydra", "omegaconf", "vllm", "megatron", "transformers", "transformer_engine", "numpy")


# ---------------------------------------------------------------------------------------------
# Fixtures: an `rl` executable for this checkout, a fake run root, a private cache
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rl_bin(tmp_path_factory) -> Path:
    """A bin/ dir whose `rl` is exactly pip's console script for rlcli.main:main, pinned to
    this checkout (an editable install elsewhere must not answer for it). Like pip's, it starts
    Python through /bin/sh when the interpreter's path cannot be a `#!` line (a space in the
    checkout or venv path, or longer than older kernels read)."""
    bin_dir = tmp_path_factory.mktemp("bin")
    rl = bin_dir / "rl"
    exe = sys.executable
    head = (f"#!{exe}\n" if " " not in exe and len(exe) < 127 else
            f"#!/bin/sh\n'''exec' {shlex.quote(exe)} \"$0\" \"$@\"\n' '''\n")
    rl.write_text(f"{head}import sys\nsys.path.insert(0, {str(REPO)!r})\n"
                  "from rlcli.main import main\nsys.exit(main())\n")
    rl.chmod(0o755)
    return bin_dir


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """cwd for the shells: a run root `ckpt/` with complete step_10, step_20, incomplete
    step_30, a save in progress, plus an unrelated directory and file."""
    root = tmp_path_factory.mktemp("work")
    run = root / "ckpt"
    for step, complete in ((10, True), (20, True), (30, False)):
        (run / f"step_{step}").mkdir(parents=True)
        if complete:
            (run / f"step_{step}" / "manifest.json").write_text("{}")
    (run / ".tmp-step_40").mkdir()
    (run / "run.json").write_text('{"format": "rl-run", "version": 1}')
    (root / "data").mkdir()
    (root / "notes.txt").write_text("x")
    return root


@pytest.fixture(scope="module")
def shell_env(rl_bin, tmp_path_factory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("home")
    return {"HOME": str(home), "PATH": f"{rl_bin}:/usr/local/bin:/usr/bin:/bin", "TERM": "screen",
            "LANG": "C.UTF-8", "RL_CACHE_DIR": str(tmp_path_factory.mktemp("cache")),
            "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}


def _run_rl(rl_bin: Path, env: dict[str, str], *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("_RL_", "_TYPER_", "COMP_"))}
    return subprocess.run([str(rl_bin / "rl"), *args], env={**base, **env}, cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def _bash_protocol(line: str) -> dict[str, str]:
    """What completions/rl.bash exports for ``line`` (bash splits words at `=`)."""
    words = re.findall(r"=|[^\s=]+", line)
    if line.endswith(" ") or not line:
        words.append("")
    return {"_RL_COMPLETE": "complete_bash", "COMP_WORDS": "\n".join(words), "COMP_CWORD": str(len(words) - 1)}


# ---------------------------------------------------------------------------------------------
# The candidates themselves (no shell)
# ---------------------------------------------------------------------------------------------

def _values(items) -> list[str]:
    return [i[0] if isinstance(i, tuple) else i for i in items]


def test_keys_complete_hydra_style(monkeypatch):
    """A leaf completes to `key=`, a node to `key.`, a group to `group=`, as Hydra does."""
    monkeypatch.delenv("_RL_COMPLETE", raising=False)
    assert "engine.param_offload=" in _values(ck.complete_override("engine.pa"))
    assert _values(ck.complete_override("trai")) == ["trainer."]
    assert set(_values(ck.complete_override("ta"))) == {"task.", "task="}
    top = _values(ck.complete_override(""))
    assert {"trainer.", "engine.", "checkpoint.", "task=", "engine=", "model=", "algorithm=", "rollout="} <= set(top)
    assert not any(v.startswith(("+", "~")) for v in top)
    assert ck.complete_override("+trainer.x") == [] and ck.complete_override("~trainer") == []


def test_group_options_are_the_config_files(monkeypatch):
    """`task=` offers exactly configs/task/*.yaml (and likewise every group), never other text."""
    from engine.config.load import group_options
    from engine.config.schema import CONFIG_GROUPS

    monkeypatch.delenv("_RL_COMPLETE", raising=False)
    for group in CONFIG_GROUPS:
        offered = _values(ck.complete_override(f"{group}="))
        assert offered == [f"{group}={o}" for o in group_options(group)], group
    assert ck.engine_options() == group_options("engine")


def test_removed_keys_are_never_offered(monkeypatch):
    """No prefix of a removed key (engine/config/removed_keys.py) completes to it."""
    from engine.config.removed_keys import REMOVED_KEYS

    monkeypatch.delenv("_RL_COMPLETE", raising=False)
    for key in REMOVED_KEYS:
        for n in range(len(key) + 1):
            assert f"{key}=" not in _values(ck.complete_override(key[:n])), (key, key[:n])
        assert ck.complete_override(f"{key}=") == []


def _parse(text: str):
    """The value as Hydra reads it on the command line (`off` is a string there, not YAML 1.1's False)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    value = OverridesParser.create().parse_override(f"k={text}").value()
    return "" if value is None and text == "" else value


@pytest.mark.parametrize("line", ["rl train ", "rl train algorithm=dr_grpo model=smollm2-135m ",
                                  "rl train --engine megatron "])
def test_defaults_shown_are_what_hydra_composes(monkeypatch, line):
    """After `key=`, the first value offered is the value `rl train` would use — the Hydra
    composition of schema, configs/rl.yaml and the groups chosen on the line — for every key."""
    from engine.config.load import compose_dict, flatten

    monkeypatch.setenv("_RL_COMPLETE", "complete_zsh")
    monkeypatch.setenv("_TYPER_COMPLETE_ARGS", line)
    overrides = [w for w in line.split()[2:] if "=" in w]
    if "--engine" in line:
        overrides.append("engine=megatron")
    composed = flatten(compose_dict(overrides))
    nodes = [v for v in _values(ck._override_items("")) if v.endswith(".")]
    leaves = []
    while nodes:  # walk nested sections too (model.lora.)
        node = nodes.pop()
        items = _values(ck._override_items(node))
        leaves += [v[:-1] for v in items if v.endswith("=")]
        nodes += [v for v in items if v.endswith(".") and v != node]
    assert set(leaves) == set(composed), set(leaves) ^ set(composed)
    for key in leaves:
        offered = _values(ck.complete_override(f"{key}="))
        if composed[key] == "":  # nothing to show; the shell falls back to file names
            assert f"{key}=" not in offered, key
            continue
        assert offered, key
        assert _parse(offered[0].split("=", 1)[1]) == composed[key], (key, offered[0], composed[key])


def test_engine_keys_follow_the_chosen_engine(monkeypatch):
    """Megatron-only keys appear once `--engine megatron` / `engine=megatron` is on the line."""
    monkeypatch.setenv("_RL_COMPLETE", "complete_fish")
    monkeypatch.setenv("_TYPER_COMPLETE_ARGS", "rl train engine.ten")
    assert ck.complete_override("engine.ten") == []
    for line in ("rl train --engine megatron engine.ten", "rl train engine=megatron engine.ten",
                 "rl train -e megatron engine.ten"):
        monkeypatch.setenv("_TYPER_COMPLETE_ARGS", line)
        assert _values(ck.complete_override("engine.ten")) == ["engine.tensor_model_parallel_size="], line


def test_bool_and_choice_values(monkeypatch):
    """Bools offer true/false; fields with metadata choices offer every choice, default first."""
    monkeypatch.delenv("_RL_COMPLETE", raising=False)
    assert _values(ck.complete_override("engine.fp8=")) == ["engine.fp8=false", "engine.fp8=true"]
    got = _values(ck.complete_override("algorithm.kl_type="))
    assert got[0] == "algorithm.kl_type=low_var_kl"
    assert set(got) == {"algorithm.kl_type=k1", "algorithm.kl_type=k2", "algorithm.kl_type=k3",
                        "algorithm.kl_type=low_var_kl"}
    assert _values(ck.complete_override("algorithm.kl_type=k")) == ["algorithm.kl_type=k1", "algorithm.kl_type=k2",
                                                                     "algorithm.kl_type=k3"]


def test_bash_completes_the_value_after_equals(monkeypatch):
    """bash splits `key=val` into `key`, `=`, `val` and replaces only the part after `=`, so the
    candidates there are bare values; a lone `key=`/`node.` comes with its continuations so
    bash inserts it without a trailing space."""
    for k, v in _bash_protocol("rl train engine.fp8=").items():
        monkeypatch.setenv(k, v)
    assert _values(ck.complete_override("=")) == ["false", "true"]
    for k, v in _bash_protocol("rl train task=ec").items():
        monkeypatch.setenv(k, v)
    assert _values(ck.complete_override("ec")) == ["echo"]
    for k, v in _bash_protocol("rl train --engine=me").items():
        monkeypatch.setenv(k, v)
    assert _values(ck.complete_override("me")) == ["megatron"]
    for k, v in _bash_protocol("rl train engine.param_off").items():
        monkeypatch.setenv(k, v)
    got = _values(ck.complete_override("engine.param_off"))
    assert got[0] == "engine.param_offload=" and len(got) > 1
    assert all(g.startswith("engine.param_offload=") for g in got)


def test_checkpoint_paths_complete_ones_first(workdir, monkeypatch):
    """In a run root, step dirs come complete first (newest first), then incomplete; saves in
    progress (.tmp-step_*) and files are not offered; elsewhere run roots end in `/`."""
    monkeypatch.delenv("_RL_COMPLETE", raising=False)
    monkeypatch.chdir(workdir)
    assert ck.complete_ckpt_path("ckpt/") == ["ckpt/step_20", "ckpt/step_10", "ckpt/step_30"]
    assert ck.complete_ckpt_path("ckpt/step_1") == ["ckpt/step_10"]
    assert ck.complete_ckpt_path("") == ["ckpt/", "data/"]
    assert ck.complete_ckpt_path("c") == ["ckpt/"]
    described = dict(ck.complete_ckpt_path_described("ckpt/"))
    assert "INCOMPLETE" in described["ckpt/step_30"] and "complete" in described["ckpt/step_20"]
    assert "notes.txt" in _values(ck.complete_inspect_path(""))
    monkeypatch.setenv("_RL_COMPLETE", "complete_bash")
    assert ck.complete_ckpt_path("c") == ["ckpt/", "ckpt/step_20", "ckpt/step_10", "ckpt/step_30"]


def test_resume_offers_only_allowed_keys_with_the_saved_values(tmp_path, monkeypatch):
    """After `rl resume PATH`: no config groups, only keys resume_rules.ALLOWED lets change,
    the run's own engine keys, and the values saved in its newest complete checkpoint."""
    from engine.checkpoint.resume_rules import ALLOWED

    run = tmp_path / "ckpt"
    for step, total in ((10, 40), (20, 60)):
        (run / f"step_{step}").mkdir(parents=True)
        manifest = {"engine": "megatron", "config": {"trainer": {"total_steps": total, "nprocs": 2},
                                                     "engine": {"name": "megatron", "param_offload": True}}}
        (run / f"step_{step}" / "manifest.json").write_text(json.dumps(manifest))
    (run / "step_30").mkdir()  # incomplete: not what resume would load
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("_RL_COMPLETE", "complete_fish")

    def offer(line: str) -> list[str]:
        monkeypatch.setenv("_TYPER_COMPLETE_ARGS", line)
        return _values(ck.complete_override(line.rsplit(" ", 1)[-1]))

    top = offer("rl resume ckpt/ ")
    assert not any(v.endswith("=") and "." not in v for v in top), top  # no `task=` & co.
    assert "optim." not in top and "model." not in top
    leaves = offer("rl resume ckpt/ engine.")
    assert "engine.tensor_model_parallel_size=" in leaves and "engine.fp8=" not in leaves
    assert all(v[:-1] in ALLOWED for v in leaves)
    assert offer("rl resume ckpt/ trainer.total_steps=")[0] == "trainer.total_steps=60"
    assert offer("rl resume ckpt/step_10 trainer.total_steps=")[0] == "trainer.total_steps=40"
    assert offer("rl resume ckpt/ engine.param_offload=")[0] == "engine.param_offload=true"


def test_a_config_file_on_the_line_gives_the_defaults_and_files_complete(tmp_path, monkeypatch):
    """`rl train --config FILE`: the file's values are the defaults offered first and its engine
    picks the engine keys (unless the line picks one); `--config <TAB>` offers YAML files and, in
    a run root, the run's config.yaml; `rl config show` completes overrides as `rl train` does."""
    run = tmp_path / "ckpt"
    (run / "step_10").mkdir(parents=True)
    (run / "step_10" / "manifest.json").write_text("{}")
    (run / "run.json").write_text('{"format": "rl-run", "version": 1}')
    (run / "config.yaml").write_text("trainer:\n  total_steps: 77\nengine:\n  name: megatron\n")
    (tmp_path / "exp.yml").write_text("task: add\n")
    (tmp_path / "notes.txt").write_text("x")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("_RL_COMPLETE", "complete_fish")

    def offer(line: str) -> list[str]:
        monkeypatch.setenv("_TYPER_COMPLETE_ARGS", line)
        return _values(ck.complete_override(line.rsplit(" ", 1)[-1]))

    assert offer("rl train --config ckpt/config.yaml trainer.total_steps=")[0] == "trainer.total_steps=77"
    assert "engine.tensor_model_parallel_size=" in offer("rl train --config ckpt/config.yaml engine.")
    assert "engine.tensor_model_parallel_size=" not in offer("rl train --config ckpt/config.yaml -e fsdp engine.")
    assert offer("rl train trainer.total_steps=")[0] == "trainer.total_steps=40"
    assert offer("rl config show --config exp.yml task=")[0].startswith("task=")
    assert "trainer.total_steps=" in offer("rl config show trainer.total")
    assert _values(ck.complete_config_file("")) == ["ckpt/", "exp.yml"]
    described = dict(ck.complete_config_file("ckpt/"))
    assert list(described) == ["ckpt/config.yaml"] and "reproduces the run" in described["ckpt/config.yaml"]


# ---------------------------------------------------------------------------------------------
# The key-tree cache
# ---------------------------------------------------------------------------------------------

def test_cache_follows_every_config_edit(tmp_path, monkeypatch):
    """The cache is named by the sources' contents: a new group file, a changed default, and a
    schema edit are all visible on the very next TAB; an unchanged tree is read from disk."""
    configs = tmp_path / "configs"
    shutil.copytree(ck._config_dir(), configs, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    monkeypatch.setattr(ck, "_config_dir", lambda: configs)
    monkeypatch.setenv("RL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("_RL_COMPLETE", raising=False)

    assert "task=mine" not in _values(ck.complete_override("task="))
    first = ck.cache_path()
    assert first.is_file()

    (configs / "task" / "mine.yaml").write_text("# @package task\n# My task.\nname: jsonl\n")
    assert "task=mine" in _values(ck.complete_override("task="))
    second = ck.cache_path()
    assert second != first and second.is_file()

    text = (configs / "rl.yaml").read_text()
    (configs / "rl.yaml").write_text(re.sub(r"total_steps: \d+", "total_steps: 77", text))
    assert _values(ck.complete_override("trainer.total_steps="))[0] == "trainer.total_steps=77"

    # Unchanged sources: served from the file, without rebuilding.
    monkeypatch.setattr(ck, "build_key_tree", lambda: pytest.fail("rebuilt although nothing changed"))
    assert _values(ck.complete_override("trainer.total_steps="))[0] == "trainer.total_steps=77"


def test_cache_key_covers_the_schema(monkeypatch, tmp_path):
    """schema.py and removed_keys.py are part of the digest (a new field or removal changes it)."""
    names = [p.name for p in ck.source_files()]
    assert {"schema.py", "removed_keys.py", "completion_keys.py", "rl.yaml"} <= set(names)
    schema = tmp_path / "schema.py"
    schema.write_text((ck._engine_config_dir() / "schema.py").read_text())
    removed = tmp_path / "removed_keys.py"
    removed.write_text((ck._engine_config_dir() / "removed_keys.py").read_text())
    monkeypatch.setattr(ck, "_engine_config_dir", lambda: tmp_path)
    before = ck.tree_digest()
    schema.write_text(schema.read_text() + "\n# a comment is a change too\n")
    assert ck.tree_digest() != before


# ---------------------------------------------------------------------------------------------
# Scripts: drift, --show-completion, --install-completion
# ---------------------------------------------------------------------------------------------

def test_completion_scripts_have_not_drifted():
    """completions/rl.{bash,zsh,fish} are what the generator writes from the Typer app today."""
    problems = completion_scripts.check(REPO / "completions")
    assert not problems, "".join(problems) + "\nrun: python -m rlcli.completion_scripts"


@pytest.mark.parametrize("shell", completion_scripts.SHELLS)
def test_show_and_install_completion_match_the_checked_in_scripts(shell, rl_bin, tmp_path):
    """`rl --show-completion SHELL` prints, and `rl --install-completion SHELL` installs, the
    same script as completions/rl.SHELL (minus its header)."""
    env = {"HOME": str(tmp_path), "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"}
    want = completion_scripts.strip_header((REPO / "completions" / f"rl.{shell}").read_text()).strip()
    shown = _run_rl(rl_bin, env, "--show-completion", shell)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == want
    installed = _run_rl(rl_bin, env, "--install-completion", shell)
    assert installed.returncode == 0, installed.stderr
    target = {"bash": tmp_path / ".bash_completions" / "rl.sh", "zsh": tmp_path / ".zfunc" / "_rl",
              "fish": tmp_path / ".config" / "fish" / "completions" / "rl.fish"}[shell]
    assert target.read_text().strip() == want
    if shell == "bash":
        assert f"source '{target}'" in (tmp_path / ".bashrc").read_text()


# ---------------------------------------------------------------------------------------------
# Start-up cost: what a TAB and --help import
# ---------------------------------------------------------------------------------------------

_PROBE = """
import atexit, json, os, sys
def _dump():
    with open(os.environ["RL_MODULES_OUT"], "w") as f:
        json.dump(sorted(sys.modules), f)
atexit.register(_dump)
sys.argv = ["rl"] + json.loads(os.environ["RL_ARGV"])
if os.environ.get("RL_PATCH") == "1":
    from rlcli.completion_keys import speed_up_completion
    speed_up_completion()
from rlcli.main import app
app(prog_name="rl")
"""


def _modules_after(tmp_path, argv: list[str], env: dict[str, str], patch: bool = False) -> tuple[set[str], str]:
    out = tmp_path / "modules.json"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("_RL_", "_TYPER_", "COMP_"))}
    r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, cwd=REPO, timeout=120,
                       env={**base, "RL_CACHE_DIR": str(tmp_path / "cache"), "RL_MODULES_OUT": str(out),
                            "RL_ARGV": json.dumps(argv), "RL_PATCH": "1" if patch else "0", **env})
    assert r.returncode in (0, 1), r.stderr
    return set(json.loads(out.read_text())), r.stdout


def _heavy(mods: set[str]) -> list[str]:
    return sorted(m for m in mods if m.split(".")[0] in HEAVY)


def test_help_and_tab_import_nothing_heavy(tmp_path):
    """`rl --help`, `rl train --help` and a TAB never import torch, ray, hydra, omegaconf,
    transformers, vllm or megatron; a TAB with a warm cache does not even read the schema."""
    for argv in (["--help"], ["train", "--help"]):
        mods, _ = _modules_after(tmp_path, argv, {})
        assert not _heavy(mods), (argv, _heavy(mods))
    tab = _bash_protocol("rl train engine.pa")
    _modules_after(tmp_path, [], tab)  # first TAB builds the cache
    mods, out = _modules_after(tmp_path, [], tab)
    assert "engine.param_offload=" in out.split()
    assert not _heavy(mods), _heavy(mods)
    assert "engine.config.schema" not in mods and "yaml" not in mods


@pytest.mark.parametrize("shell,line", [("bash", "rl train engine.pa"), ("bash", "rl train task="),
                                        ("bash", "rl "), ("zsh", "rl train engine.fp8="), ("zsh", "rl tr"),
                                        ("fish", "rl train ta"), ("fish", "rl train --engine ")])
def test_speed_up_completion_keeps_answers_and_skips_pydantic_and_rich(tmp_path, shell, line):
    """speed_up_completion() (for rlcli.main.main) changes no candidate, and a TAB with it
    imports neither pydantic (Typer's value coercion) nor rich (Typer's help rendering)."""
    env = _bash_protocol(line) if shell == "bash" else {
        "_RL_COMPLETE": f"complete_{shell}", "_TYPER_COMPLETE_ARGS": line, "_TYPER_COMPLETE_FISH_ACTION": "get-args"}
    _, stock = _modules_after(tmp_path, [], env)
    mods, fast = _modules_after(tmp_path, [], env, patch=True)

    def values(text: str) -> list[str]:
        if shell == "zsh":
            return re.findall(r'^\(?\(?"((?:[^"]|"")*)"', text.split("((", 1)[-1], re.M)
        return [ln.split("\t")[0] for ln in text.splitlines()]

    assert values(fast) == values(stock) and values(fast), (stock, fast)
    assert "pydantic" not in mods and "rich" not in mods, sorted(m for m in mods if m.startswith(("pydantic", "rich")))


def test_inspect_ckpt_completes_checkpoints_and_files(rl_bin, workdir):
    """`rl inspect-ckpt <TAB>` offers step dirs of a run root (complete first) and, unlike
    resume, files too (a safetensors or torch.save file is a valid target)."""
    out = _run_rl(rl_bin, {"RL_CACHE_DIR": str(workdir / ".cache"), **_bash_protocol("rl inspect-ckpt ckpt/")},
                  cwd=workdir).stdout.split()
    if out[:2] != ["ckpt/step_20", "ckpt/step_10"]:
        pytest.fail("`rl inspect-ckpt PATH` does not complete checkpoints (got %r): in rlcli/commands/"
                    "inspect_ckpt.py give the path Argument autocompletion=<fn returning "
                    "rlcli.completion_keys.complete_inspect_path(incomplete)>" % out)
    assert "ckpt/run.json" in out


# ---------------------------------------------------------------------------------------------
# Real shells, through tmux
# ---------------------------------------------------------------------------------------------

PROMPT = "RLTAB> "


class TmuxShell:
    """One interactive shell in a private tmux server: type, press TAB, read the screen."""

    def __init__(self, shell: str, cwd: Path, env: dict[str, str], name: str):
        self.shell, self.sock = shell, f"rl-completion-test-{os.getpid()}-{name}-{uuid.uuid4().hex[:8]}"
        self.tmux = ["tmux", "-L", self.sock, "-f", "/dev/null"]
        argv = {"bash": "bash --norc --noprofile", "zsh": "zsh -f", "fish": "fish --no-config"}[shell]
        envs = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())  # tmp paths may hold spaces
        subprocess.run(self.tmux + ["new-session", "-d", "-x", "220", "-y", "50", "-s", "t", "-c", str(cwd),
                                    f"env -i {envs} {argv}"], check=True)
        try:
            self._setup()
        except BaseException:
            self.close()  # never leave a tmux server behind
            raise

    def _setup(self) -> None:
        shell = self.shell
        script = shlex.quote(str(REPO / "completions" / f"rl.{shell}"))  # the checkout path may hold spaces
        setup = {
            "bash": f"PS1='{PROMPT}'; source {script}",
            "zsh": f"PS1='{PROMPT}'; autoload -Uz compinit && compinit -u -D; source {script}",
            "fish": f"function fish_prompt; printf '{PROMPT}'; end; set -g fish_autosuggestion_enabled 0; "
                    f"source {script}",
        }[shell]
        self.wait(r"\S")  # the shell's own prompt: it reads the terminal now
        self.keys("-l", setup)
        self.keys("Enter")
        self.wait(rf"^{re.escape(PROMPT.rstrip())}\s*$")  # capture-pane drops trailing blanks
        self.reset()

    def keys(self, *keys: str) -> None:
        subprocess.run(self.tmux + ["send-keys", "-t", "t", *keys], check=True)

    def screen(self) -> str:
        return subprocess.run(self.tmux + ["capture-pane", "-p", "-t", "t"], check=True,
                              capture_output=True, text=True).stdout

    def wait(self, pattern: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if re.search(pattern, screen, re.M):
                return screen
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.shell}: /{pattern}/ never appeared; screen:\n{screen}")
            time.sleep(0.1)

    def reset(self) -> None:
        """An empty command line on a cleared screen (C-c drops the line, C-l clears)."""
        empty = rf"{re.escape(PROMPT.rstrip())}\s*\Z"
        for attempt in range(6):  # a key landing while the shell redraws or runs `rl` can be eaten
            try:
                self.keys("C-c")
                self.wait(empty, timeout=5.0)
                self.keys("C-l")
                self.wait(rf"\A{empty}", timeout=5.0)
                return
            except AssertionError:
                if attempt == 5:
                    raise

    def tab(self, typed: str, tabs: int, expect: str) -> str:
        """Type ``typed``, press TAB ``tabs`` times, wait for ``expect`` on screen."""
        self.reset()
        self.keys("-l", typed)
        for _ in range(tabs):
            self.keys("Tab")
        return self.wait(expect)

    def close(self) -> None:
        subprocess.run(self.tmux + ["kill-server"], capture_output=True)


@pytest.fixture(params=["bash", "zsh", "fish"])
def shell(request, shell_env, workdir):
    for binary in ("tmux", request.param):
        if shutil.which(binary) is None:
            pytest.skip(f"`{binary}` is not installed (CI: apt-get install -y zsh fish tmux)")
    sh = TmuxShell(request.param, workdir, shell_env, request.param)
    sh.cwd = workdir
    yield sh
    sh.close()


def _list_tabs(shell: TmuxShell) -> int:
    """bash lists ambiguous candidates on the second TAB; zsh and fish on the first."""
    return 2 if shell.shell == "bash" else 1


def test_tab_completes_a_config_key(shell):
    """`rl train engine.param_o<TAB>` becomes `engine.param_offload=` with no space after, and
    the next TAB offers its values; `engine.pa<TAB>` lists the engine keys."""
    line = rf"^{re.escape(PROMPT)}rl train engine\.param_offload="
    shell.tab("rl train engine.param_o", 1, line + r"\s*$")
    shell.keys("Tab")
    if shell.shell == "bash":
        shell.keys("Tab")
    shell.wait(r"\bfalse\b[\s\S]*\btrue\b")
    screen = shell.tab("rl train engine.pa", _list_tabs(shell), r"param_offload=")
    assert "pad_to_length" in screen and "grad_offload" not in screen


def test_tab_completes_group_options(shell):
    """`rl train task=<TAB>` lists configs/task/*.yaml."""
    screen = shell.tab("rl train task=", _list_tabs(shell), r"\bparquet\b")
    for option in ("add", "echo", "jsonl", "parquet"):
        assert re.search(rf"\b{option}\b", screen.split(PROMPT, 1)[-1]), (option, screen)


def test_tab_completes_subcommands_and_options(shell):
    """`rl tr<TAB>` -> `rl train`; `rl train --eng<TAB>` -> `--engine`; its values are the engines."""
    shell.tab("rl tr", 1, rf"^{re.escape(PROMPT)}rl train\s*$")
    shell.tab("rl train --eng", 1, rf"^{re.escape(PROMPT)}rl train --engine\s*$")
    screen = shell.tab("rl train --engine ", _list_tabs(shell), r"\bmegatron\b")
    assert "fsdp" in screen.split(PROMPT, 1)[-1]


def test_tab_completes_checkpoint_paths(shell, rl_bin, shell_env):
    """`rl resume <TAB>` offers the run root, then its step dirs (not run.json, not the save in
    progress)."""
    listed = _run_rl(rl_bin, {**shell_env, **_bash_protocol("rl ")}).stdout.split()
    assert "resume" in listed, listed
    offered = _run_rl(rl_bin, {**shell_env, **_bash_protocol("rl resume ")}, cwd=shell.cwd).stdout
    if "ckpt/" not in offered.split():
        pytest.fail("`rl resume PATH` does not complete checkpoints: in rlcli/commands/resume.py give the path "
                    "Argument autocompletion=<fn returning rlcli.completion_keys.complete_ckpt_path_described("
                    "incomplete)>")
    shell.tab("rl resume ck", 1, rf"^{re.escape(PROMPT)}rl resume ckpt/\s*$")
    # Only step dirs are offered inside a run root, so their common prefix is inserted.
    shell.tab("rl resume ckpt/", 1, rf"^{re.escape(PROMPT)}rl resume ckpt/step_\s*$")
    screen = shell.tab("rl resume ckpt/step_", _list_tabs(shell), r"step_30")
    tail = screen.split(PROMPT, 1)[-1]
    assert "step_10" in tail and "step_20" in tail
    assert "run.json" not in tail and ".tmp-step" not in tail
