"""Compare two checkpoint reports: tensors added, removed, reshaped or re-typed; non-tensor
entries added or removed; saved config values changed. Works across formats (names are
compared as each reader spells them)."""

from __future__ import annotations

from engine.inspect.config_check import flatten_config
from engine.inspect.report import Change, CheckpointReport, DiffReport


def diff_reports(a: CheckpointReport, b: CheckpointReport) -> DiffReport:
    """What changed from ``a`` to ``b``."""
    d = DiffReport(a=a.path, b=b.path, a_format=a.format, b_format=b.format,
                   a_step=a.step, b_step=b.step)
    ta = {t.name: t for t in a.tensors}
    tb = {t.name: t for t in b.tensors}
    d.added = [tb[n] for n in sorted(tb.keys() - ta.keys())]
    d.removed = [ta[n] for n in sorted(ta.keys() - tb.keys())]
    for n in sorted(ta.keys() & tb.keys()):
        x, y = ta[n], tb[n]
        same = True
        if tuple(x.shape) != tuple(y.shape):
            d.shape_changed.append(Change(n, str(list(x.shape)), str(list(y.shape))))
            same = False
        if x.dtype != y.dtype:
            d.dtype_changed.append(Change(n, x.dtype, y.dtype))
            same = False
        d.unchanged += same
    oa = {o.name for o in a.objects}
    ob = {o.name for o in b.objects}
    d.objects_added = sorted(ob - oa)
    d.objects_removed = sorted(oa - ob)
    ca, cb = flatten_config(a.config or {}), flatten_config(b.config or {})
    for k in sorted(ca.keys() | cb.keys()):
        va, vb = ca.get(k, "<absent>"), cb.get(k, "<absent>")
        if va != vb:
            d.config_changed.append(Change(k, repr(va), repr(vb)))
    return d
