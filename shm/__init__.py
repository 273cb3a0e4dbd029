"""Shared-memory rings for what crosses processes every step (see ring.py, frames.py)."""

from gapless.shm.names import cleanup_run, ring_name, run_id_of, sweep_stale
from gapless.shm.ring import RingFull, ShmRing

__all__ = ["RingFull", "ShmRing", "cleanup_run", "ring_name", "run_id_of", "sweep_stale"]
