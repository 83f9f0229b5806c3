"""Small file helpers shared by the readers: sizes on disk, JSON/YAML side files."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, Optional

from engine import json_safe
from engine.errors import CheckpointError
from engine.checkpoint.io.records import FileInfo


def list_files(root: Path, *, relative_to: Optional[Path] = None) -> list[FileInfo]:
    """Every regular file under ``root`` (recursively, hidden ones included), sorted."""
    base = relative_to or root
    out: list[FileInfo] = []
    if root.is_file():
        return [FileInfo(root.name if relative_to is None else str(root.relative_to(base)),
                         root.stat().st_size)]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            p = Path(dirpath) / name
            try:
                size = p.stat().st_size
            except OSError:
                continue
            out.append(FileInfo(str(p.relative_to(base)), size))
    return out


MAX_JSON_BYTES = 256 << 20  # side files are kilobytes; a larger one is refused unread


def require_regular_file(path: Path, shown: str) -> None:
    """Refuse (CheckpointError) anything but a regular file, before opening it: a FIFO would
    block forever and a device (/dev/zero) never ends."""
    try:
        st = path.stat()
    except OSError as e:
        raise CheckpointError(f"cannot read {shown}: {e.strerror or e}.", title="unreadable checkpoint") from None
    if not stat.S_ISREG(st.st_mode):
        from engine.user_paths import file_kind

        raise CheckpointError(f"{shown} is {file_kind(st)}, not a checkpoint file; it is not read. Pass a checkpoint "
                              "directory or file (e.g. ckpt/ or ckpt/step_40).", title="not a checkpoint")


def read_json(path: Path, *, what: str) -> Any:
    """Parse a JSON side file; a corrupt one is a CheckpointError naming ``what``."""
    require_regular_file(path, what)
    if path.stat().st_size > MAX_JSON_BYTES:
        raise CheckpointError(f"{what} ({path}) is {path.stat().st_size:,} bytes; a checkpoint's JSON files are "
                              "kilobytes. Refused unread.", title="corrupt checkpoint")
    try:
        return json_safe.loads(path.read_text())
    except OSError as e:
        raise CheckpointError(f"cannot read {what} ({path}): {e.strerror}.") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(
            f"{what} ({path}) is truncated or corrupt: not valid JSON ({e}). "
            "The save that wrote it did not finish; pick another checkpoint.",
            title="corrupt checkpoint") from None


def read_yaml(path: Path) -> Optional[Any]:
    """Parse a YAML side file (config.yaml); None if unreadable (it is informational)."""
    try:
        from engine import yaml_safe

        return yaml_safe.safe_load(path.read_text(), str(path))  # bounded: no alias bomb
    except Exception:
        return None


def dir_size(root: Path) -> tuple[int, int]:
    """(bytes, files) of everything under ``root``."""
    total = count = 0
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            try:
                total += (Path(dirpath) / name).stat().st_size
                count += 1
            except OSError:
                pass
    return total, count


def human_bytes(n: Optional[int]) -> str:
    """1536 -> '1.5 KiB'."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
