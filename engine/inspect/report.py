"""What `rl inspect-ckpt` found: plain result objects, one ``to_json()`` each.

Readers (one module per format) fill a :class:`CheckpointReport` for a single checkpoint
or a :class:`RunReport` for a directory holding several; :mod:`engine.inspect.diff`
compares two checkpoint reports into a :class:`DiffReport`. The CLI renders these objects
as tables and prints ``to_json()`` for ``--json``: both views come from the same fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from engine.checkpoint.io.records import GROUPS, FileInfo, ObjectInfo, TensorInfo  # noqa: F401  (parts of every report)


@dataclass
class GroupSummary:
    """Totals for one group of entries (model, optimizer state, rng...)."""

    group: str
    tensors: int = 0
    elements: int = 0
    bytes: int = 0
    dtypes: dict[str, int] = field(default_factory=dict)  # dtype -> number of tensors
    objects: int = 0  # non-tensor entries

    def to_json(self) -> dict:
        return {"group": self.group, "tensors": self.tensors, "elements": self.elements,
                "bytes": self.bytes, "dtypes": dict(self.dtypes), "objects": self.objects}


@dataclass
class OptimizerCoverage:
    """Which parameters carry optimizer state, which do not, and state with no parameter.

    ``none_expected``: no state, and the manifest says so (the parameter had no gradient
    yet): ``rl resume`` backfills these. ``none_unexpected``: no state and nothing says
    why: ``rl resume`` refuses them unless ``--allow-partial``.
    """

    state_names: list[str] = field(default_factory=list)  # e.g. exp_avg, exp_avg_sq, step
    params: int = 0
    full: list[str] = field(default_factory=list)
    partial: dict[str, list[str]] = field(default_factory=dict)  # fqn -> missing state names
    none_expected: list[str] = field(default_factory=list)
    none_unexpected: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)  # optimizer entries naming no parameter
    orphan_params: list[str] = field(default_factory=list)  # the parameter names they use
    source: str = ""  # which naming scheme was recognised
    manifest: bool = False  # an rl manifest said which parameters may lack state

    def to_json(self) -> dict:
        return {"source": self.source, "manifest": self.manifest, "state_names": list(self.state_names),
                "params": self.params, "full": len(self.full),
                "partial": {k: list(v) for k, v in self.partial.items()},
                "none_expected": list(self.none_expected),
                "none_unexpected": list(self.none_unexpected),
                "orphans": list(self.orphans), "orphan_params": list(self.orphan_params)}


@dataclass
class ConfigIssue:
    """A saved config key that the current `rl` no longer accepts."""

    key: str
    replacement: str  # new key ("" when removed without one)
    reason: str
    saved_value: Any = None

    def to_json(self) -> dict:
        return {"key": self.key, "replacement": self.replacement, "reason": self.reason,
                "saved_value": self.saved_value}


@dataclass
class CheckpointReport:
    """Everything the inspector learned about one checkpoint."""

    path: str
    format: str  # rl | dcp | megatron | safetensors | verl-fsdp | torch-save
    format_detail: str = ""  # one line: what was recognised and how
    step: Optional[int] = None
    world_size: Optional[int] = None
    layout: dict[str, Any] = field(default_factory=dict)  # e.g. {"dp": 2, "tp": 1} or files per rank
    complete: bool = True
    incomplete_reasons: list[str] = field(default_factory=list)
    files: list[FileInfo] = field(default_factory=list)
    tensors: list[TensorInfo] = field(default_factory=list)
    objects: list[ObjectInfo] = field(default_factory=list)
    config: Optional[dict] = None
    versions: dict[str, str] = field(default_factory=dict)
    optimizer: Optional[OptimizerCoverage] = None
    config_issues: list[ConfigIssue] = field(default_factory=list)
    config_check: str = ""  # how the config check went ("" when there is no config)
    notes: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)  # format-specific facts (samples_seen...)
    verification: Optional[dict] = None  # --verify: engine.checkpoint.verify.Verification.to_json()

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def groups(self) -> list[GroupSummary]:
        """Per-group totals, in :data:`GROUPS` order, groups with no entry left out."""
        by: dict[str, GroupSummary] = {}
        for t in self.tensors:
            g = by.setdefault(t.group, GroupSummary(t.group))
            g.tensors += 1
            g.elements += t.numel
            g.bytes += t.nbytes
            g.dtypes[t.dtype] = g.dtypes.get(t.dtype, 0) + 1
        for o in self.objects:
            by.setdefault(o.group, GroupSummary(o.group)).objects += 1
        order = {g: i for i, g in enumerate(GROUPS)}
        return sorted(by.values(), key=lambda g: (order.get(g.group, len(order)), g.group))

    def select(self, pattern: str) -> list[TensorInfo]:
        """Tensors whose name matches the glob ``pattern`` (fnmatch, case-sensitive)."""
        from fnmatch import fnmatchcase

        return [t for t in self.tensors if fnmatchcase(t.name, pattern)]

    def to_json(self, keys: Optional[str] = None) -> dict:
        """The report as JSON-ready data. ``keys`` adds the matching per-tensor rows."""
        out = {
            "kind": "checkpoint",
            "path": self.path,
            "format": self.format,
            "format_detail": self.format_detail,
            "step": self.step,
            "world_size": self.world_size,
            "layout": dict(self.layout),
            "complete": self.complete,
            "incomplete_reasons": list(self.incomplete_reasons),
            "files": [f.to_json() for f in self.files],
            "total_bytes": self.total_bytes,
            "groups": [g.to_json() for g in self.groups()],
            "totals": {"tensors": len(self.tensors),
                       "elements": sum(t.numel for t in self.tensors),
                       "bytes": sum(t.nbytes for t in self.tensors),
                       "objects": len(self.objects)},
            "optimizer": self.optimizer.to_json() if self.optimizer else None,
            "config": self.config,
            "config_check": self.config_check,
            "config_issues": [c.to_json() for c in self.config_issues],
            "versions": dict(self.versions),
            "info": dict(self.info),
            "notes": list(self.notes),
            "verification": self.verification,
        }
        if keys is not None:
            out["keys"] = keys
            out["tensors"] = [t.to_json() for t in self.select(keys)]
        return out


@dataclass
class StepInfo:
    """One checkpoint directory inside a run root."""

    name: str  # directory name: step_40, global_step_40, iter_0000040, .tmp-step_60
    step: Optional[int]
    complete: bool
    reason: str = ""  # why not complete (or "" when complete)
    bytes: int = 0
    files: int = 0
    latest: bool = False
    created: str = ""
    samples_seen: Optional[int] = None
    verification: Optional[dict] = None  # --verify on a run root: each complete step's result

    def to_json(self) -> dict:
        return {"name": self.name, "step": self.step, "complete": self.complete,
                "reason": self.reason, "bytes": self.bytes, "files": self.files,
                "latest": self.latest, "created": self.created,
                "samples_seen": self.samples_seen, "verification": self.verification}


@dataclass
class RunReport:
    """A directory of checkpoints (an `rl` run root, a verl or Megatron save dir)."""

    path: str
    format: str  # rl-run | verl-run | megatron-run
    steps: list[StepInfo] = field(default_factory=list)
    latest: Optional[str] = None  # name of the latest complete step, None if there is none
    info: dict[str, Any] = field(default_factory=dict)  # run.json, pointer file contents...
    versions: dict[str, str] = field(default_factory=dict)
    files: list[FileInfo] = field(default_factory=list)  # run-level files (config.yaml...)
    notes: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.steps) + sum(f.bytes for f in self.files)

    def to_json(self) -> dict:
        return {"kind": "run", "path": self.path, "format": self.format,
                "latest": self.latest, "steps": [s.to_json() for s in self.steps],
                "files": [f.to_json() for f in self.files], "total_bytes": self.total_bytes,
                "info": dict(self.info), "versions": dict(self.versions),
                "notes": list(self.notes)}


@dataclass
class Change:
    """One tensor whose shape or dtype differs between two checkpoints."""

    name: str
    before: str
    after: str

    def to_json(self) -> dict:
        return {"name": self.name, "before": self.before, "after": self.after}


@dataclass
class DiffReport:
    """What changed from checkpoint ``a`` to checkpoint ``b``: keys, shapes, dtypes."""

    a: str
    b: str
    a_format: str
    b_format: str
    a_step: Optional[int] = None
    b_step: Optional[int] = None
    added: list[TensorInfo] = field(default_factory=list)
    removed: list[TensorInfo] = field(default_factory=list)
    shape_changed: list[Change] = field(default_factory=list)
    dtype_changed: list[Change] = field(default_factory=list)
    unchanged: int = 0
    objects_added: list[str] = field(default_factory=list)
    objects_removed: list[str] = field(default_factory=list)
    config_changed: list[Change] = field(default_factory=list)

    @property
    def identical_layout(self) -> bool:
        return not (self.added or self.removed or self.shape_changed or self.dtype_changed
                    or self.objects_added or self.objects_removed)

    def to_json(self) -> dict:
        return {"kind": "diff", "a": self.a, "b": self.b,
                "a_format": self.a_format, "b_format": self.b_format,
                "a_step": self.a_step, "b_step": self.b_step,
                "added": [t.to_json() for t in self.added],
                "removed": [t.to_json() for t in self.removed],
                "shape_changed": [c.to_json() for c in self.shape_changed],
                "dtype_changed": [c.to_json() for c in self.dtype_changed],
                "unchanged": self.unchanged,
                "objects_added": list(self.objects_added),
                "objects_removed": list(self.objects_removed),
                "config_changed": [c.to_json() for c in self.config_changed],
                "identical_layout": self.identical_layout}
