"""Segment names, `gapless-<run_id>-<channel>-<pid>-<n>` in /dev/shm, and their cleanup.

run_id is the run directory's name without its `gapless-` prefix (`<supervisor pid>-<random>`,
see launch.py's make_run_dir), so the supervisor finds every segment of its run, and a
later start finds those of runs whose supervisor is dead.
"""

from __future__ import annotations

import itertools
import os
import re

SHM_DIR = "/dev/shm"
PREFIX = "gapless-"

_counter = itertools.count()


def run_id_of(run_dir: str) -> str:
    """The run id of a run directory: `/tmp/gapless-123-ab_c` -> `123-ab_c`."""
    base = os.path.basename(os.path.normpath(run_dir))
    return _safe(base.removeprefix(PREFIX))


def ring_name(run_id: str, channel: str) -> str:
    """A fresh segment name for one producer's ring on `channel`, unique within the run."""
    return f"{PREFIX}{run_id}-{_safe(channel)}-{os.getpid()}-{next(_counter)}"


_RING_NAME = re.compile(r"gapless-[A-Za-z0-9_.-]+")


def check_ring_name(name: str, run_id: str | None = None) -> str:
    """`name` if it can be one of our segments (of run `run_id`, when given): our prefix and
    only [A-Za-z0-9_.-] after it, so joined to SHM_DIR it names a file there and nowhere else.
    ValueError otherwise."""
    if not _RING_NAME.fullmatch(name) or name in (".", ".."):
        raise ValueError(f"{name!r} is not a gapless ring name")
    if run_id is not None and not name.startswith(f"{PREFIX}{_safe(run_id)}-"):
        raise ValueError(f"ring {name!r} is not of run {run_id}")
    return name


def _safe(part: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", part)


def cleanup_run(run_id: str) -> list[str]:
    """Unlink every segment of one run; returns the names removed."""
    prefix = f"{PREFIX}{_safe(run_id)}-"
    return [n for n in _names() if n.startswith(prefix) and _unlink(n)]


def sweep_stale() -> list[str]:
    """Unlink segments of runs whose supervisor pid is dead; returns the names removed."""
    removed = []
    for name in _names():
        try:
            pid = int(name.split("-")[1])
        except (IndexError, ValueError):
            continue
        if not pid_alive(pid) and _unlink(name):
            removed.append(name)
    return removed


def _names() -> list[str]:
    try:
        return [n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)]
    except FileNotFoundError:
        return []


def _unlink(name: str) -> bool:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        return False
    return True


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (someone else's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
