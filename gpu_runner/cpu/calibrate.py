"""The cpu's step time by tokens fed, measured at start: speculation's cost model (core/spec_cost.py).

Where one row and eight cost about the same (the weights are read once either way) drafts are
nearly free; where the cores are busy with arithmetic every verified token costs as much as a
decoded one. Which is which depends on this CPU, its threads and the model's format, so it is
measured here, not taken from another machine: one forward of n tokens (one sequence from
position 0, on the path a verify step of n tokens takes: padded decode rows through the
compiled step where the batch expands verifies, else the eager forward) for n = 1, 2, 4,
... up to the step budget or CALIBRATE_MAX_TOKENS, the best of a few runs each, after one run
that is not timed (first uses of a shape). Padded, every size between two measured ones runs
as the larger: the table holds that step (a point one past the smaller at the larger's time),
so the cost model never prices 5 tokens between 4 and 8 when they run as 8. The KV blocks it wrote are zeroed after.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from gapless.gpu_runner.attention import StepLayout
from gapless.gpu_runner.batch import IDS, LOGIT_ROWS, POSITIONS, SLOT_MAPPING, TOK_SLOT
from gapless.gpu_runner.executor import StepExecutor
from gapless.gpu_runner.graph import padded_size

RUNS = 2  # per size, the fastest kept: other programs on the cores only slow a run down
# why a cap: past a few dozen tokens a cpu step is bound by arithmetic, so the cost model
# extends the table along its last segment instead of paying seconds at start to measure it
CALIBRATE_MAX_TOKENS = 64


def _forward(ex: StepExecutor, padded: bool, rows: int, meta) -> None:
    if padded:
        ex.graphs.run(rows, meta)
    else:
        ex.forward(rows, meta, 1)


@torch.inference_mode()
def step_seconds(ex: StepExecutor, sizes: list[int]) -> tuple[list[int], list[float]]:
    """(tokens, seconds): the eager forward's time for each size the KV cache can hold."""
    bs = ex.batch.block_size
    tokens, seconds = [], []
    for n in sizes:
        num_pages = -(-n // bs)
        if num_pages + 1 > ex.num_blocks or n > ex.batch.table.shape[0]:
            break
        pages = np.arange(1, num_pages + 1, dtype=np.int64)  # block 0 is the scratch block
        pos = np.arange(n, dtype=np.int64)
        table = ex.batch.table[:n]
        table.zero_()
        table[:, IDS] = 0
        table[:, TOK_SLOT] = 0
        table[:, POSITIONS] = torch.from_numpy(pos)
        table[:, SLOT_MAPPING] = torch.from_numpy(pages[pos // bs] * bs + pos % bs)
        table[0, LOGIT_ROWS] = n - 1
        padded = ex.use_graphs and ex.batch.expand_verify and n <= ex.batch.max_padded
        if padded:  # as a verify of decodes runs: a padded decode row per token
            rows = padded_size(n)
            table[n:rows].zero_()
            table[:n, LOGIT_ROWS] = torch.arange(n)
            ctx = np.ones(rows, dtype=np.int64)
            ctx[:n] = pos + 1
            page_rows = np.zeros((rows, num_pages), dtype=np.int64)
            page_rows[:n] = pages
            layout = StepLayout(np.ones(rows, np.int64), ctx, page_rows, bs)
        else:
            rows = n
            layout = StepLayout(np.array([n]), np.array([n]), pages[None, :], bs)
        best = float("inf")
        _forward(ex, padded, rows, ex.attn.build(layout, ex.batch.column(SLOT_MAPPING, rows)))
        for _ in range(RUNS):
            meta = ex.attn.build(layout, ex.batch.column(SLOT_MAPPING, rows))
            start = time.perf_counter()
            _forward(ex, padded, rows, meta)
            best = min(best, time.perf_counter() - start)
        if padded and tokens and tokens[-1] + 1 < rows:  # why: n - 1 tokens and n pad alike
            tokens.append(tokens[-1] + 1)
            seconds.append(best)
        tokens.append(n)
        seconds.append(best)
        for kv in ex.kv_cache:  # leave no trace: these blocks are the pool's
            for cache in kv:
                cache[bs : (num_pages + 1) * bs].zero_()
    ex.batch.table.zero_()
    return tokens, seconds
