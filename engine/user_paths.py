"""Checks on the paths a user names on the command line, made before anything is read or written.

Every way a path can fail (it does not exist, loops through symbolic links, is too long, cannot
be read, names a file where a directory is needed, is a FIFO or a device that a read would wait
on or never finish) becomes a :class:`UserError` naming the path, the problem and the fix, never
an ``OSError`` traceback. Pure standard library: any layer may use it.

- :func:`stat_path`: ``os.stat`` of an input path, or None when nothing is there.
- :func:`file_kind`: "a FIFO (named pipe)", "a device", ... for a stat result.
- :func:`check_output_dir` / :func:`check_output_file`: where a command is about to write.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Optional

from engine.errors import UserError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

_PROBLEMS = {
    errno.ENOENT: "does not exist",
    errno.EISDIR: "is a directory where a file was expected",
    errno.EEXIST: "already exists",
    errno.EDQUOT: "is over the disk quota",
    errno.ELOOP: "loops through symbolic links (a link that points, directly or not, back at itself)",
    errno.ENAMETOOLONG: "is too long for the file system (a path or one of its names is over the limit)",
    errno.EACCES: "cannot be accessed (permission denied)",
    errno.EPERM: "cannot be accessed (operation not permitted)",
    errno.ENOTDIR: "goes through a file as if it were a directory",
    errno.EIO: "cannot be read (the device reported an I/O error)",
    errno.EROFS: "is on a read-only file system",
    errno.ENOSPC: "is on a full disk",
}


def os_problem(e: OSError) -> str:
    """What an OSError from a path says, as the rest of a sentence starting with the path."""
    return _PROBLEMS.get(e.errno or -1, f"cannot be used ({e.strerror or e})")


def shown(path) -> str:
    """A path for a message: control characters (a newline in a name) escaped, very long ones cut."""
    s = str(path)
    if any(ord(c) < 32 or ord(c) == 127 for c in s):
        s = repr(s)[1:-1]
    return s if len(s) <= 300 else f"{s[:140]}...{s[-140:]} ({len(s)} characters)"


def file_kind(st: os.stat_result) -> str:
    m = st.st_mode
    return ("a directory" if stat.S_ISDIR(m) else "a regular file" if stat.S_ISREG(m) else
            "a FIFO (named pipe)" if stat.S_ISFIFO(m) else
            "a device" if stat.S_ISCHR(m) or stat.S_ISBLK(m) else
            "a socket" if stat.S_ISSOCK(m) else "not a regular file")


def stat_path(path, what: str, *, error=UserError, title: str = "bad path") -> Optional[os.stat_result]:
    """``os.stat(path)``; None when nothing is there (ENOENT). Any other failure (a symlink loop,
    a name too long, permission denied, a file used as a directory) is ``error`` naming
    ``what`` (e.g. "the checkpoint path /x") and the problem."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ENOTDIR:
            return None  # "a/file.txt/b": nothing is there, as for a missing path
        raise error(f"{what} {os_problem(e)}. Check the path and pass an existing, readable one.",
                    title=title) from None
    except ValueError:  # an embedded NUL byte
        raise error(f"{what} contains a NUL byte; no file can have that name.", title=title) from None


def _nearest_existing(path: Path, what: str) -> tuple[Path, os.stat_result]:
    p = Path(os.path.abspath(path))
    while True:
        st = stat_path(p, f"{what} ({shown(path)})", title="cannot write there")
        if st is not None:
            return p, st
        if p.parent == p:
            raise UserError(f"{what} {shown(path)}: no part of the path exists.", title="cannot write there")
        p = p.parent


def check_writable_parent(path, what: str) -> None:
    """Where ``path`` would be created, the nearest directory that exists must be a directory
    this process may write into (a file in the way, /proc, a read-only mount are refused)."""
    anc, st = _nearest_existing(Path(path).parent, what)
    if not stat.S_ISDIR(st.st_mode):
        raise UserError(f"{what} {shown(path)} cannot be created: {shown(anc)} is {file_kind(st)}, not a "
                        "directory. Choose a path under a directory.", title="cannot write there")
    try:
        vfs = os.statvfs(anc)
        read_only = bool(vfs.f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only or not os.access(anc, os.W_OK | os.X_OK) or _virtual_fs(anc):
        why = "is on a read-only file system" if read_only else "cannot be written to"
        raise UserError(f"{what} {shown(path)} cannot be created: {shown(anc)} {why}. Choose a directory you "
                        "can write to.", title="cannot write there")


def _virtual_fs(p: Path) -> bool:
    """/proc and /sys: writable-looking to root, yet nothing can be created in them."""
    parts = Path(os.path.realpath(p)).parts
    return len(parts) > 1 and parts[1] in ("proc", "sys")


def _lstat_output(out, what: str, other: str) -> Optional[os.stat_result]:
    """``os.lstat`` of an output path: None when nothing is there (or a file is in the way of a
    parent, which the parent check names); any other failure is a UserError."""
    try:
        return os.lstat(out)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno != errno.ENOTDIR:
            raise UserError(f"{what} {shown(out)} {os_problem(e)}. Choose another {other}.",
                            title="cannot write there") from None
        return None


def check_output_dir(out, what: str = "--out") -> Optional[os.stat_result]:
    """An output directory about to be written: what is there already must be a directory
    (a FIFO, a device or a regular file in the way is refused, never replaced), and where it is
    missing it must be creatable. Returns its stat (None when it does not exist yet)."""
    lst = _lstat_output(out, what, "directory")
    if lst is not None and stat.S_ISLNK(lst.st_mode):
        raise UserError(f"{what} {shown(out)} is a symbolic link; it is not replaced. Give the directory it "
                        "points to, or another path.", title="output exists")
    if lst is not None and not stat.S_ISDIR(lst.st_mode):
        raise UserError(f"{what} {shown(out)} is {file_kind(lst)}; it is never replaced. Give a directory path "
                        "(it is created).", title="output exists")
    check_writable_parent(out, what)  # written as a sibling first, then renamed into place
    return lst


def check_output_file(out, what: str, *, magic: bytes | None = None, kind: str = "file") -> None:
    """An output file about to be (re)written: an existing one must be a regular file that starts
    with ``magic`` (an earlier output of the same kind), so a typo never replaces a user's other
    files (metrics.jsonl, a config) or a device; a missing one must be creatable."""
    lst = _lstat_output(out, what, "path")
    if lst is not None:
        if stat.S_ISLNK(lst.st_mode):
            raise UserError(f"{what} {shown(out)} is a symbolic link; it is not replaced. Give another path.",
                            title="output exists")
        if not stat.S_ISREG(lst.st_mode):
            raise UserError(f"{what} {shown(out)} is {file_kind(lst)}; it is never replaced. Give a file path.",
                            title="output exists")
        if magic is not None:
            try:
                with open(out, "rb") as f:
                    head = f.read(len(magic))
            except OSError as e:
                raise UserError(f"{what} {shown(out)} {os_problem(e)}.", title="cannot write there") from None
            if head != magic and lst.st_size > 0:
                raise UserError(f"{what} {shown(out)} already exists and is not a {kind}; it is not replaced. "
                                f"Give a new file name (or remove that file first).", title="output exists")
    check_writable_parent(out, what)


def read_jsonl(path, what: str, *, error=UserError) -> tuple[list[tuple[int, object]], list[int]]:
    """The lines of a JSON-lines file a run wrote (metrics.jsonl, memory.jsonl): ([(line number,
    parsed value)], [numbers of lines that are not JSON]); blank lines are skipped, a missing
    file is ([], []). Bytes that are not UTF-8 (a damaged file, binary garbage) make their line
    unparseable instead of failing the whole read; anything but a regular file (a directory, a
    FIFO that would block, /dev/zero that never ends) is ``error``, never opened."""
    rows, bad = [], []
    for i, value in iter_jsonl(path, what, error=error):
        if value is NOT_JSON:
            bad.append(i)
        else:
            rows.append((i, value))
    return rows, bad


NOT_JSON = object()  # what iter_jsonl yields for a line that is not JSON


def iter_jsonl(path, what: str, *, error=UserError):
    """``read_jsonl`` one line at a time: (line number, parsed value or NOT_JSON) for each
    non-blank line, so a caller that keeps a few numbers of each row (`rl plot` on a long run's
    metrics.jsonl) never holds the whole file. The path is checked (and opened) at the call,
    not at the first ``next``: the same errors as read_jsonl, raised where it is called."""
    st = stat_path(path, what, error=error, title="unreadable run file")
    if st is None:
        return iter(())
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{what} is {file_kind(st)}, not a file of JSON rows; it is not read. A run writes it as a "
                    "regular file: move that one away (or point the command at the run directory that wrote it).",
                    title="unreadable run file")
    try:
        f = open(path, "rb")
    except OSError as e:
        raise error(f"{what} {os_problem(e)}.", title="unreadable run file") from None
    return _jsonl_lines(f, what, error)


def _jsonl_lines(f, what: str, error):
    from engine import json_safe

    i = 0
    with f:
        while True:
            try:
                raw = f.readline()
            except OSError as e:
                raise error(f"{what} {os_problem(e)}.", title="unreadable run file") from None
            if not raw:
                return
            for line in raw.decode("utf-8", errors="replace").splitlines():  # as str.splitlines on the whole text
                i += 1
                if not line.strip():
                    continue
                try:
                    value = json_safe.loads(line)
                except ValueError:
                    value = NOT_JSON
                yield i, value


RUN_FILE_SUFFIXES = (".jsonl", ".json", ".yaml", ".db")  # the run-root files a run writes, rewrites or appends to
RUN_SUBDIRS = ("tensorboard", "wandb", "mlartifacts")  # the loggers' directories inside a run (engine/tracking)


def refuse_special_run_files(root, *, error=UserError) -> None:
    """A run directory's own files (metrics.jsonl, memory.jsonl, config.yaml, run.json, mlflow.db,
    ...) and its loggers' directories (tensorboard/, wandb/, mlartifacts/) are written, rewritten
    or appended to while a run goes on; rl only ever writes regular files and directories
    there. One that is a symlink (rows appended wherever it points: another user's file), a FIFO
    (a write that waits forever), a device or a directory is refused before anything is read
    or written. Nothing there yet: nothing to check."""
    root = Path(root)
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return  # no directory yet (or not listable: the writability probe names that)
    for entry in entries:
        st = entry.lstat()
        if entry.name in RUN_SUBDIRS:
            if stat.S_ISDIR(st.st_mode):
                continue  # a logger's own directory (a symlink is refused below: events written wherever it points)
        elif entry.suffix not in RUN_FILE_SUFFIXES or stat.S_ISREG(st.st_mode):
            continue
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else file_kind(st)
        wanted = "a directory" if entry.name in RUN_SUBDIRS else "a regular file"
        raise error(f"{shown(entry)} is {kind}, where rl writes {wanted} of the run as it goes; rl never writes "
                    f"through {kind}. Move it out of {shown(root)} (the run recreates what it needs) and run the "
                    f"command again.", title="run directory unusable")


def append_to_run_file(path, data: bytes) -> None:
    """Append ``data`` to a run file in one write, never through a symlink (O_NOFOLLOW), never
    into a FIFO or device (opened non-blocking, then required to be a regular file); if the
    write fails (disk full), cut the file back to where it was, so it never ends in half a row."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO):  # a symlink (O_NOFOLLOW) / a FIFO without a reader
            what = "a symbolic link" if e.errno == errno.ELOOP else "a FIFO (named pipe)"
            raise UserError(f"{shown(path)} is {what}; rl appends a run's rows only to regular files it wrote, "
                            f"never through {what}. Move it out of the run directory and run again.",
                            title="run directory unusable") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"{shown(path)} is {file_kind(st)}; rl appends a run's rows only to regular files. "
                            f"Move it out of the run directory and run again.", title="run directory unusable")
        start = os.lseek(fd, 0, os.SEEK_END)
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view):]
        except OSError:  # disk full: cut back to where the file was, never half a row
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass
            raise
    finally:
        os.close(fd)
