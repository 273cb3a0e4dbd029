"""Giving back the KV blocks that fell out of a sliding window while their request runs.

When every layer of the model slides (ModelInfo.kv_window: Mistral, Mixtral, Phi-3 with a
window in config.json), a query at position q reads only the keys at q - window + 1 .. q. A
running request whose next step starts at position s never reads a key below s - window + 1
again, so block i (positions i * bs .. (i + 1) * bs - 1) goes back to the pool once
(i + 1) * bs + window - 1 <= s: a decoding request holds at most ceil(window / bs) + 1 blocks.
The runner keeps such a block in the request's block table, where the window's mask hides its
positions, so nothing is sent for it. A model with any global layer (Gemma 2 and 3 alternate)
keeps every block: giving back the sliding layers' blocks alone would need a pool per kind of
layer, which gapless does not have.

Why a later owner's writes never reach a reader (core/kv_blocks.py, invariant 6): every step
that reads the block was planned before the step being planned now, and the runner runs plans
in order. With prefix caching a block is registered before it goes back, so it joins the LRU
with its name, as a finished request's block does; but a long request's first blocks join it
before its last ones, so under pressure they are evicted first, and with its head evicted its
chain is lost to later lookups.

Per step this costs one array compare while the steady-decode plan's rows are unchanged, and
a pass of a Python loop for each request whose window crosses a block boundary (every
block_size steps per request).
"""

from __future__ import annotations

import numpy as np

from gapless.core.kv_blocks import BlockManager
from gapless.core.prefix import PrefixCache
from gapless.core.rows import Rows
from gapless.core.running import RunningBatch


class WindowRelease:
    def __init__(
        self, window: int, blocks: BlockManager, rb: RunningBatch, prefix: PrefixCache
    ) -> None:
        assert window > 0
        self.window = window  # keys a query sees, its own included
        self.blocks = blocks
        self.rb = rb
        self.prefix = prefix

    def free_at(self, slots: np.ndarray) -> np.ndarray:
        """[n] the first position a step must start at for each slot's next block to go back."""
        bs = self.blocks.block_size
        return (self.rb.num_freed[slots] + 1) * bs + self.window - 1

    def release_due(self, rows: Rows, start: np.ndarray) -> None:
        """Give back what fell out of the window of rows whose next steps start at [n] start."""
        due = np.flatnonzero(start >= self.free_at(rows.slots))
        if len(due):
            self.release(rows, due, start)

    def release(self, rows: Rows, due: np.ndarray, start: np.ndarray) -> None:
        """Give back the blocks wholly behind the window of the rows `due` ([k] row indices),
        whose next steps start at start[j]."""
        rb, prefix, requests = self.rb, self.prefix, rows.requests
        assert rows.slots is not None, "rows on their slots"
        slots = rows.slots[due]  # [k]
        first = rb.num_freed[slots]  # [k] blocks given back so far
        # [k] blocks wholly before the first key a query at start[j] sees
        stop = np.minimum((start[due] - self.window + 1) // self.blocks.block_size,
                          rb.num_blocks[slots])  # fmt: skip
        named: list[int] = []  # given back registered: they join the LRU
        unnamed: list[int] = []  # given back empty
        each = zip(due.tolist(), first.tolist(), stop.tolist(), strict=True)
        for k, (j, f, e) in enumerate(each):
            req = requests[j]
            if prefix.enabled and req.num_named < e and prefix.keeps(req, f):
                # registered first (all it has filled: the next few need no call), so they go
                # back reusable; those whose ids are not known yet (samples in flight) wait
                prefix.offer(req, int(start[j]), f)
                e = stop[k] = max(min(e, req.num_named), f)
            n = min(max(req.num_named, f), e)  # the registered ones lead (kv_blocks inv. 6)
            named += req.blocks[f:n]
            unnamed += req.blocks[n:e]
        self.blocks.free(named + unnamed, len(named))
        rb.num_freed[slots] = stop
