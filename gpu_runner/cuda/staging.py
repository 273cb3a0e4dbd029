"""The step's table on cuda: written into one of a ring of pinned host tables, then copied to
the device table with a non-blocking copy on the current stream.

why a ring: the device may run steps behind the host, so a host table is rewritten only once
the copy that last read it has run; the runner has at most three steps in flight.
"""

from __future__ import annotations

import numpy as np
import torch

STAGING_DEPTH = 3  # pinned host tables


class PinnedTables:
    def __init__(self, shape: tuple[int, int], device: torch.device) -> None:
        self.table = torch.zeros(shape, dtype=torch.long, device=device)  # [rows, NUM_COLS]
        self._staging = [
            torch.zeros(shape, dtype=torch.long, pin_memory=True) for _ in range(STAGING_DEPTH)
        ]
        self._copied: list[torch.cuda.Event | None] = [None] * STAGING_DEPTH  # each copy done
        self._turn = 0

    def host(self) -> np.ndarray:
        """The next staging table, once the copy that last read it has run."""
        self._turn = (self._turn + 1) % len(self._staging)
        done = self._copied[self._turn]
        if done is not None and not done.query():
            done.synchronize()  # why: rewriting it now would race the copy
        return self._staging[self._turn].numpy()

    def upload(self, rows: int) -> None:
        self.table[:rows].copy_(self._staging[self._turn][:rows], non_blocking=True)
        done = self._copied[self._turn]
        if done is None:
            done = self._copied[self._turn] = torch.cuda.Event()
        done.record()
