"""Schemas a hostile client sends to cost the server, and what they leave behind: shared by
the grammar tests."""

from __future__ import annotations

import os
import time
from typing import Any


def runaway_schema(i: int = 0, patterns: int = 30) -> dict[str, Any]:
    """A small schema whose compile does not end on its own: llguidance intersects the allOf's
    search patterns into one regex, taking a core and ever more memory. i makes it distinct."""
    parts = [{"type": "string", "pattern": f".*a{j}r{i}.*"} for j in range(patterns)]
    return {"type": "string", "allOf": parts}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
