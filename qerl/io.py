"""Atomic file and directory writes: a crashed stage never leaves a half-written output behind.

A temporary is a hidden sibling named `.{target}.{host}.{pid}.{pid_start}.{random}.tmp`, so the next write of the
same target can tell whose it is: those of a dead process of this host (a killed stage) are removed first; a live
process's temporary, or another host's (its process cannot be seen from here), is never touched. Results honour
the umask (mkstemp/mkdtemp alone would make them 0600/0700).
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


def process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), or None where unknown;
    with the pid it names one process, even after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def process_alive(pid: int, start: str | None = None) -> bool:
    """Whether process `pid` of this host (started at `start`, if given) still runs; unknown counts as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    now = process_start(pid)
    return start is None or now is None or now == start


def owner_tag() -> str:
    """host.pid.pid_start of this process: what a temporary's name records of its owner."""
    return f"{socket.gethostname()}.{os.getpid()}.{process_start(os.getpid()) or 0}"


def remove_stale_temporaries(path: str | Path) -> list[Path]:
    """Remove the temporaries of `path` left by dead processes of this host; return what was removed."""
    path = Path(path)
    # (-journal etc.: what SQLite keeps beside a temporary database that was being written)
    pattern = re.compile(re.escape(f".{path.name}.{socket.gethostname()}.")
                         + r"(\d+)\.(\d+)\.[a-z0-9_]+\.tmp(?:-journal|-wal|-shm)?")
    removed = []
    try:
        entries = list(path.parent.iterdir())
    except FileNotFoundError:
        return removed
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m is None or process_alive(int(m.group(1)), None if m.group(2) == "0" else m.group(2)):
            continue
        _remove(entry)
        removed.append(entry)
    return removed


def _remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        entry.unlink(missing_ok=True)


def current_umask() -> int:
    mask = os.umask(0o077)  # the only portable way to read it; restrictive for the instant it is set
    os.umask(mask)
    return mask


def honour_umask(tree: str | Path) -> None:
    """Give every file and folder under `tree` the mode a plain open()/mkdir() would: 0666 & ~umask, 0777 & ~umask
    for folders and executables. Some writers (transformers' model.safetensors, via mkstemp) make files 0600,
    which an output a group shares must not be."""
    mask = current_umask()
    for root, dirs, files in os.walk(tree):
        for d in dirs:
            if not os.path.islink(p := os.path.join(root, d)):
                os.chmod(p, 0o777 & ~mask)
        for f in files:
            p = os.path.join(root, f)
            if os.path.islink(p) or not os.path.isfile(p):
                continue
            executable = os.stat(p).st_mode & 0o111
            os.chmod(p, (0o777 if executable else 0o666) & ~mask)


def _prefix(path: Path) -> str:
    return f".{path.name}.{owner_tag()}."


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield an empty temporary sibling file; on success it replaces `path` in one rename (mode 0666 & ~umask)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=_prefix(path), suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> Path:
    with atomic_file(path) as tmp:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    return Path(path)


def atomic_write_json(path: str | Path, data: Any) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


@contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces `path` in one rename (mode 0777 & ~umask, and
    every file in it 0666 & ~umask whatever wrote it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=_prefix(path), suffix=".tmp"))
    try:
        yield tmp
        honour_umask(tmp)
        os.chmod(tmp, 0o777 & ~current_umask())
        if path.exists():
            # the old output also gets an owned temporary name: if we die before deleting it, the next run does
            old = path.with_name(f"{_prefix(path)}{secrets.token_hex(4)}.tmp")
            path.rename(old)
            tmp.rename(path)
            _remove(old)
        else:
            tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
