"""Memory results as plain dataclasses: what a rank measured per phase, what the estimator
predicts, and the two side by side. Every class has ``to_json()`` (a JSON-able dict) so
``rl mem-report`` only renders them, and ``--json`` prints exactly the same content.

Measured records are stored one JSON object per line (``memory.jsonl`` in the run
directory): ``save_records`` / ``load_records``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Optional

from engine import json_safe

# Categories of bytes, in display order. Every estimate and measurement uses these keys.
CATEGORIES = ("params", "grads", "optimizer", "activations", "activations_host", "logits", "fp8_workspaces",
              "kv_cache")
CATEGORY_HELP = {
    "params": "model parameters held on the rank (policy + reference)",
    "grads": "gradients",
    "optimizer": "optimizer state (AdamW moments; fp32 master copy when params are bf16)",
    "activations": "tensors saved for backward by the model's forward (one micro-batch), on the device",
    "activations_host": "saved activations offloaded to host memory (engine.activation_offload; one micro-batch)",
    "logits": "logits and log-prob buffers ([tokens, vocab] per micro-batch)",
    "fp8_workspaces": "Transformer-Engine FP8 weight copies (_fp8_workspaces)",
    "kv_cache": "rollout KV cache",
}

# Phases of one RL step, in order.
PHASES = ("rollout", "old_log_probs", "ref_log_probs", "values", "update", "critic_update", "weight_sync", "offload",
          "onload")  # values / critic_update: algorithm=ppo's critic

# what-if rows: param / optimizer state offload, and activation offload (alone, and with both)
OFFLOAD_MODES = ("none", "param", "optimizer", "both", "activations", "all")

RECORDS_FILE = "memory.jsonl"


def _clean(obj):
    """JSON-able copy: dataclasses -> dicts, NaN/inf -> None, tuples -> lists."""
    if hasattr(obj, "to_json") and not isinstance(obj, type):
        return obj.to_json()
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [_clean(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


class _JSON:
    def to_json(self) -> dict:
        return {f.name: _clean(getattr(self, f.name)) for f in fields(self)}  # type: ignore[arg-type]


# PhaseRecord fields that are read as numbers, strings or containers: (accepted type names, wording)
_RECORD_TYPES = {"phase": (("str",), "a string"), "device": (("str",), "a string"),
                 "step": (("int",), "an integer"), "rank": (("int",), "an integer"),
                 "seconds": (("int", "float"), "a number"), "categories": (("dict",), "a mapping"),
                 "host_offload": (("dict",), "a mapping"), "offload": (("dict", "None"), "a mapping or null"),
                 "notes": (("list",), "a list"),
                 **{k: (("int", "float", "None"), "a number or null") for k in (
                     "allocated", "reserved", "peak_allocated", "peak_reserved", "device_used", "device_total",
                     "non_torch", "rss", "peak_rss", "heap_in_use", "heap_held")}}


def _is_a(v, want: tuple) -> bool:
    import math

    kinds = want[0]
    if v is None:
        return "None" in kinds
    if isinstance(v, bool):
        return False
    if isinstance(v, (int, float)) and not isinstance(v, int) and not math.isfinite(v):
        return False
    if isinstance(v, int) and abs(v) >= 2**63:  # no byte count or step is that big (10**400: a float overflow later)
        return False
    return type(v).__name__ in kinds


def _shown_value(v) -> str:
    """A damaged value for a message: its repr, cut when long (a 400-digit number)."""
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


@dataclass
class PhaseRecord(_JSON):
    """What one rank measured during one phase of one step.

    ``categories``: bytes of live tensors by category (peak within the phase).
    CUDA fields are None on CPU; ``rss``/``peak_rss`` are the process's resident memory at
    the end and its peak during the phase (recorded on every device); ``heap_in_use`` /
    ``heap_held`` split host malloc's share of it at the end into memory still referenced and
    memory freed but kept (glibc only; a leak grows the first, a high-water mark the second).
    """

    phase: str
    step: int = 0
    rank: int = 0
    device: str = "cpu"
    seconds: float = 0.0
    categories: dict = field(default_factory=dict)
    allocated: Optional[int] = None
    reserved: Optional[int] = None
    peak_allocated: Optional[int] = None
    peak_reserved: Optional[int] = None
    device_used: Optional[int] = None      # total - free from mem_get_info (includes non-torch)
    device_total: Optional[int] = None
    non_torch: Optional[int] = None        # device_used - reserved: NCCL, vLLM, CUDA context...
    rss: Optional[int] = None
    peak_rss: Optional[int] = None
    heap_in_use: Optional[int] = None       # host malloc (glibc): bytes the process still references
    heap_held: Optional[int] = None         # ... and bytes it freed that malloc keeps (not a leak)
    host_offload: dict = field(default_factory=dict)   # kind -> {"buffers", "offloaded"} bytes
    offload: Optional[dict] = None          # OffloadReport fields, for offload/onload phases
    notes: list = field(default_factory=list)

    @classmethod
    def from_json(cls, d: dict) -> "PhaseRecord":
        """Raises ValueError naming the field when a value has the wrong type (a damaged or edited
        memory.jsonl: a null rank or a NaN byte count was a TypeError traceback in `rl mem-report`)."""
        names = {f.name for f in fields(cls)}
        kept = {k: v for k, v in d.items() if k in names}
        for k, v in kept.items():
            want = _RECORD_TYPES.get(k)
            if want is not None and not _is_a(v, want):
                raise ValueError(f"`{k}` is {_shown_value(v)}, not {want[1]}")
        for k, v in (kept.get("categories") or {}).items():
            if not _is_a(v, (("int", "float"), "a number")):
                raise ValueError(f"`categories.{k}` is {_shown_value(v)}, not a number")
        return cls(**kept)

    @property
    def peak_bytes(self) -> Optional[int]:
        """The phase's peak on its device: allocator peak on CUDA, process RSS peak on CPU."""
        return self.peak_allocated if self.peak_allocated is not None else self.peak_rss


@dataclass
class PhaseEstimate(_JSON):
    """Predicted bytes per category that must be on the device during one phase, per rank."""

    phase: str
    categories: dict = field(default_factory=dict)
    total: int = 0


@dataclass
class WhatIfRow(_JSON):
    """One offload setting: device and host bytes per rank, and whether it fits."""

    mode: str                              # none | param | optimizer | both | activations | all
    overrides: list = field(default_factory=list)
    device_bytes: int = 0                  # peak over phases
    peak_phase: str = ""
    host_bytes: int = 0                    # host buffers holding offloaded state
    fits: Optional[bool] = None            # None when the device size is unknown
    headroom_bytes: Optional[int] = None


@dataclass
class Fix(_JSON):
    """A config change and how many bytes of the per-rank device peak it saves."""

    name: str
    overrides: list
    bytes_saved: int
    new_peak_bytes: int
    fits: Optional[bool] = None
    why: str = ""


@dataclass
class MemoryEstimate(_JSON):
    """Per-rank device memory predicted for one run config."""

    model: str                             # where the architecture came from
    param_count: int
    model_bytes: int                       # all params, unsharded, in the param dtype
    backend: str
    layout: dict                           # {"dp", "tp", "pp", "cp", "nprocs"}
    dtype: str
    assumptions: dict                      # shapes and choices the numbers rest on
    per_rank: dict                         # category -> bytes per rank (training state, one
                                           # micro-batch, the rollout's KV cache)
    phases: list                           # [PhaseEstimate]
    peak_phase: str
    peak_bytes: int
    device_memory_bytes: Optional[int]
    offload_matrix: list                   # [WhatIfRow]
    fixes: list                            # [Fix], best first
    formulas: dict                         # category -> how it was computed
    notes: list = field(default_factory=list)
    moe: Optional[dict] = None             # mixture of experts: experts, expert/router params, routing
                                           # record bytes (per rollout batch on host, per micro-batch on device)
    rollout_worker: Optional[dict] = None  # trainer.mode samples ahead: the rollout worker's own bytes
                                           # (params, kv_cache, logits, total) and rank 0's peak if it shares its device

    def phase(self, name: str) -> Optional[PhaseEstimate]:
        return next((p for p in self.phases if p.phase == name), None)


@dataclass
class ComparisonRow(_JSON):
    phase: str
    category: str
    estimate: Optional[int]
    measured: Optional[int]
    diff_pct: Optional[float]              # (measured - estimate) / estimate * 100


@dataclass
class FP8Summary(_JSON):
    offloads: int = 0                      # parameter offloads recorded
    workspaces_cleared: int = 0            # entries cleared over all offloads
    bytes_freed: int = 0
    last_cleared: int = 0                  # entries cleared by the latest offload
    last_bytes_freed: int = 0


@dataclass
class MemoryReport(_JSON):
    """Everything ``rl mem-report`` shows: estimate, measured peaks, both side by side."""

    source: str                            # "estimate", a run directory, or "measured run"
    estimate: Optional[MemoryEstimate] = None
    measured: list = field(default_factory=list)      # [PhaseRecord], peak over steps per (rank, phase)
    comparison: list = field(default_factory=list)    # [ComparisonRow]
    fp8: FP8Summary = field(default_factory=FP8Summary)
    steps: list = field(default_factory=list)         # steps the measurements cover


# ---- measured records ---------------------------------------------------------------------
def save_records(records: list, path) -> Path:
    """Append records (PhaseRecord or dicts) to a JSON-lines file; returns its path."""
    path = Path(path)
    if path.is_dir():
        path = path / RECORDS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    from engine.user_paths import append_to_run_file

    append_to_run_file(path, "".join(json.dumps(_clean(r)) + "\n" for r in records).encode())
    return path


def load_records(path) -> list[PhaseRecord]:
    """Records from ``memory.jsonl`` (or a run directory that contains one)."""
    path = Path(path)
    if path.is_dir():
        path = path / RECORDS_FILE
    out = []
    with path.open() as f:
        for line in f:
            line = line.strip()
            if line:
                out.append(PhaseRecord.from_json(json_safe.loads(line)))
    return out


def _max_opt(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


def peak_per_phase(records: list[PhaseRecord]) -> list[PhaseRecord]:
    """One record per (rank, phase): the element-wise max over steps (latest step's notes)."""
    out: dict[tuple, PhaseRecord] = {}
    for r in records:
        key = (r.rank, r.phase)
        cur = out.get(key)
        if cur is None:
            out[key] = PhaseRecord.from_json(r.to_json())
            continue
        for name in ("allocated", "reserved", "peak_allocated", "peak_reserved", "device_used",
                     "non_torch", "rss", "peak_rss", "device_total", "heap_in_use", "heap_held"):
            setattr(cur, name, _max_opt(getattr(cur, name), getattr(r, name)))
        cur.seconds = max(cur.seconds, r.seconds)
        for c, v in r.categories.items():
            cur.categories[c] = max(cur.categories.get(c, 0), v)
        cur.step = max(cur.step, r.step)
        if r.offload is not None:
            cur.offload = r.offload
    order = {p: i for i, p in enumerate(PHASES)}
    return sorted(out.values(), key=lambda r: (r.rank, order.get(r.phase, len(order)), r.phase))


def fp8_summary(records: list[PhaseRecord]) -> FP8Summary:
    s = FP8Summary()
    for r in sorted(records, key=lambda r: r.step):
        if r.phase == "offload" and r.offload:
            s.offloads += 1
            n = int(r.offload.get("fp8_workspaces_cleared", 0))
            b = int(r.offload.get("fp8_workspace_bytes_freed", 0))
            s.workspaces_cleared += n
            s.bytes_freed += b
            s.last_cleared, s.last_bytes_freed = n, b
    return s


def compare(estimate: MemoryEstimate, records: list[PhaseRecord], rank: int = 0) -> list[ComparisonRow]:
    """Estimate beside measured, per phase x category, for one rank (peaks over steps)."""
    rows = []
    measured = {r.phase: r for r in peak_per_phase(records) if r.rank == rank}
    for pe in estimate.phases:
        m = measured.get(pe.phase)
        for c in CATEGORIES:
            e = pe.categories.get(c)
            v = m.categories.get(c) if m is not None else None
            if not e and not v:
                continue
            diff = (v - e) / e * 100.0 if (e and v is not None) else None
            rows.append(ComparisonRow(pe.phase, c, e, v, None if diff is None else round(diff, 1)))
    return rows


def build_report(source: str, estimate: Optional[MemoryEstimate] = None,
                 records: Optional[list[PhaseRecord]] = None) -> MemoryReport:
    """Assemble what ``rl mem-report`` renders from an estimate and/or measured records."""
    records = records or []
    return MemoryReport(
        source=source,
        estimate=estimate,
        measured=peak_per_phase(records),
        comparison=compare(estimate, records) if (estimate is not None and records) else [],
        fp8=fp8_summary(records),
        steps=sorted({r.step for r in records}),
    )


def offload_report_dict(report) -> dict:
    """An engine.backends.base.OffloadReport as a JSON-able dict."""
    return asdict(report)
