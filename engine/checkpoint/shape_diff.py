"""The difference between the tensors a model expects and those a checkpoint holds, by name and
shape: what `rl resume` (engine/checkpoint/restore.py) and `rl export` (engine/export/weights.py)
check before reading any tensor, each phrasing its own refusal."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShapeDiff:
    missing: list[str]                                # expected, not in the checkpoint
    unknown: list[str]                                # in the checkpoint, not expected
    wrong: list[tuple[str, tuple, tuple]]             # (name, checkpoint shape, expected shape)

    def __bool__(self) -> bool:
        return bool(self.missing or self.unknown or self.wrong)


def shape_diff(expected: dict[str, tuple], saved: dict[str, tuple], also_known: frozenset | set = frozenset()
               ) -> ShapeDiff:
    """``expected`` / ``saved``: name -> shape. Names in ``also_known`` (aliases the model accepts
    besides its own, e.g. a tied head) are never reported as unknown."""
    shape = lambda s: None if s is None else tuple(s)  # noqa: E731  (None: an entry that is not a tensor)
    return ShapeDiff(
        missing=[n for n in expected if n not in saved],
        unknown=[n for n in saved if n not in expected and n not in also_known],
        wrong=[(n, shape(saved[n]), shape(s)) for n, s in expected.items()
               if n in saved and shape(saved[n]) != shape(s)])
