"""The import rules in pyproject.toml ([tool.importlinter], docs/architecture.md) hold, and each
one really catches the violation it exists for: a copy of the tree with one forbidden import
added must fail `lint-imports`, naming that contract."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = shutil.which("lint-imports")
pytestmark = pytest.mark.skipif(LINT is None, reason="import-linter is not installed (pip install -e '.[test]')")


def _lint(tree: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([LINT, "--no-cache"], cwd=tree, env=env, capture_output=True, text=True, timeout=120)


def test_the_tree_keeps_every_import_rule():
    r = _lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "BROKEN" not in r.stdout and " KEPT" in r.stdout


# (file, forbidden import added to it, contract that must break). The first five are the
# violations the tree had before the rules existed (issue 20), the rest guard the other rules.
VIOLATIONS = [
    ("engine/memory/offload.py", "from engine.backends.base import TrainEngine",
     "memory does not import the training backends"),
    ("engine/memory/measure.py", "from engine.trainer.trainer import train",
     "checkpoint, memory and rollout do not import the trainer"),
    ("engine/rollout/vllm_sampler.py", "import engine.backends.base",
     "rollout does not import the training backends"),
    ("engine/config/validate.py", "import engine.device",
     "config imports no torch"),
    ("engine/checkpoint/plan.py", "from engine.trainer.run_dir import RunDir",
     "checkpoint, memory and rollout do not import the trainer"),
    ("engine/algorithms/advantages.py", "import ray",
     "algorithms are pure"),
    ("engine/backends/fsdp/engine.py", "import engine.backends.megatron.engine",
     "backends do not import each other"),
    ("engine/moe/routing_metrics.py", "import engine.backends.base",
     "moe imports neither the backends nor the trainer"),
    ("engine/errors.py", "import rich",
     "engine never imports the CLI layer"),
    ("engine/evaluate/pass_at_k.py", "import engine.trainer.trainer",
     "evaluate runs in one process"),
    # the layers: the edges that once made every engine package one cycle (issue 45)
    ("engine/tracking/fanout.py", "import engine.trainer.trainer", "layers:"),
    ("engine/checkpoint/verify.py", "import engine.inspect.detect", "layers:"),
    ("engine/config/validate.py", "import engine.tasks.registry", "layers:"),
    ("engine/data/formats.py", "import engine.tasks.base", "layers:"),
    ("engine/batch.py", "import engine.moe.routing_records", "layers:"),
    ("engine/trainer/preflight.py", "import engine.inspect.hf_safetensors",
     "the training runtime never imports the offline tools"),
    # reward models: torch stays out of the reward workers; rl eval's scorers stay out of Ray
    ("engine/rewards/scorers.py", "import engine.reward_model.model", "layers:"),
    ("engine/reward_model/build.py", "import engine.reward_model.actor",
     "evaluate runs in one process"),
]


@pytest.mark.parametrize("rel,line,contract", VIOLATIONS, ids=[v[0] for v in VIOLATIONS])
def test_each_rule_catches_its_violation(tmp_path, rel, line, contract):
    for pkg in ("engine", "rlcli"):
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / rel
    if not target.exists():
        pytest.fail(f"{rel} no longer exists: update VIOLATIONS to the module that replaced it")
    target.write_text(target.read_text() + f"\n{line}  # added by {Path(__file__).name}\n")
    r = _lint(tmp_path)
    assert r.returncode != 0, f"adding `{line}` to {rel} broke no contract:\n{r.stdout}"
    broken = [ln for ln in r.stdout.splitlines() if ln.endswith("BROKEN")]
    assert any(ln.startswith(contract) for ln in broken), (contract, broken)


def _layered_packages() -> list[str]:
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["type"] == "layers")["layers"]
    return [m.strip() for layer in layers for part in layer.split("|") for m in part.split(":")]


def test_every_engine_package_has_a_layer():
    """The layers contract only checks the modules it names: a new package left out of it could
    import anything. Every package and top-level module of engine/ must be placed."""
    placed = set(_layered_packages())
    children = {f"engine.{p.stem if p.is_file() else p.name}" for p in (ROOT / "engine").iterdir()
                if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").exists()}
    assert children - placed == set(), f"place these in the layers contract in pyproject.toml: {children - placed}"


def test_the_engine_package_graph_has_no_cycle():
    """Package level, imports inside functions included: no two engine packages import each
    other, directly or around a loop (they were one strongly connected component of 16)."""
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("engine", include_external_packages=False)
    pkg = {m: ".".join(m.split(".")[:2]) for m in graph.modules}
    edges: dict[str, set[str]] = {}
    for m in graph.modules:
        for imp in graph.find_modules_directly_imported_by(m):
            if pkg[m] != pkg[imp] and pkg[imp] != "engine":
                edges.setdefault(pkg[m], set()).add(pkg[imp])
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            pytest.fail("import cycle: " + " -> ".join(path[path.index(node):] + [node]))
        if node in done:
            return
        for nxt in sorted(edges.get(node, ())):
            visit(nxt, path + [node])
        done.add(node)

    for start in sorted(edges):
        visit(start, [])


def test_the_driver_loop_imports_without_torch():
    """`rl train`'s driver starts the Ray ranks before it loads torch (engine/trainer/trainer.py),
    so the ~1 s of torch import overlaps the ranks' start. Importing the loop's module (what
    rlcli.run_render does first) must therefore not import torch; a module-level `import torch`
    in anything it imports put that second back on every run's critical path once already."""
    code = ("import sys, engine.trainer.trainer, engine.trainer.worker_group; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert "torch" not in r.stdout and "transformers" not in r.stdout, r.stdout


def test_architecture_doc_lists_every_module():
    """docs/architecture.md has one line per module of engine/ and rlcli/ (so a newcomer's map
    stays complete)."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    modules = [p.relative_to(ROOT).as_posix() for pkg in ("engine", "rlcli") for p in (ROOT / pkg).rglob("*.py")
               if p.name != "__init__.py"]
    missing = [m for m in modules if f"`{m}`" not in doc]
    assert missing == [], f"add a line for each to docs/architecture.md: {missing}"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
