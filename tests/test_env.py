"""`rl env`: the versions a bug report needs, as a table and as JSON, from engine/env_info.py."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from importlib.metadata import version

from typer.testing import CliRunner

from rlcli.main import app


def test_env_json_reports_the_installed_versions():
    """`rl env --json` gives the real installed versions (python, torch and its CUDA build,
    megatron-core, Ray, transformers, hydra-core, typer, rich, rl) and null for what is absent."""
    import torch
    import typer

    r = CliRunner().invoke(app, ["env", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    v = data["versions"]
    assert v["python"] == platform.python_version()
    assert v["torch"] == torch.__version__
    assert v["cuda"] == (torch.version.cuda or "none")
    assert v["typer"] == typer.__version__
    for name in ("ray", "transformers", "hydra-core", "rich", "rl"):
        assert v[name] == version(name), name
    for name in ("megatron-core", "transformer-engine", "vllm"):
        assert name in v  # present even when not installed (null), so reports are comparable
    assert data["platform"]["cpus"] == str(__import__("os").cpu_count())


def test_env_table_lists_components_and_no_torch_skips_cuda():
    """The table names every component; --no-torch leaves out the CUDA/GPU rows."""
    r = CliRunner().invoke(app, ["env"])
    assert r.exit_code == 0, r.output
    for name in ("python", "torch", "cuda", "megatron-core", "transformer-engine", "vllm", "ray", "transformers",
                 "hydra-core", "typer", "rich", "rl"):
        assert name in r.stdout, name
    data = json.loads(CliRunner().invoke(app, ["env", "--json", "--no-torch"]).stdout)
    assert "cuda" not in data["versions"] and data["versions"]["torch"]


def test_env_info_is_engine_side():
    """engine/env_info.py imports neither typer nor rich (the CLI renders), nor torch until asked."""
    code = ("import sys, engine.env_info as e; r = e.collect(probe_torch=False); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('typer', 'rich', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
