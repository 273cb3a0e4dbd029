"""Benchmark of the runner's input preparation for one steady-decode plan (cpu): the static
token table, decode padding and the torch path's attention metadata."""

from __future__ import annotations

import numpy as np
import pytest

from gapless.common.messages import StepPlan
from gapless.gpu_runner.batch import POSITIONS, SLOT_MAPPING, PersistentBatch
from gapless.gpu_runner.cpu.attention import TorchAttention
from gapless.gpu_runner.graph import capture_sizes, padded_size

BLOCK = 16
CONTEXT = 500  # tokens already in each slot's cache
MAX_MODEL_LEN = 4096


def steady(batch: int) -> tuple[PersistentBatch, TorchAttention, StepPlan]:
    max_blocks = MAX_MODEL_LEN // BLOCK
    rows = capture_sizes(batch)[-1]
    pb = PersistentBatch(batch, max_blocks, BLOCK, max(512, rows), "cpu")
    attn = TorchAttention(rows, MAX_MODEL_LEN, BLOCK, 0.125, kernel=False)
    per_seq = -(-(CONTEXT + 1) // BLOCK)
    for slot in range(batch):
        pb.add(slot)
        pb.num_blocks[slot] = per_seq
        pb.block_table[slot, :per_seq] = 1 + slot * per_seq + np.arange(per_seq)
    plan = StepPlan(
        seq=1,
        new_slots=[],
        freed_slots=[],
        slots=list(range(batch)),
        num_tokens=[1] * batch,
        start_pos=[CONTEXT - (slot % BLOCK) for slot in range(batch)],  # ragged last blocks
        has_tokens=[False] * batch,
        token_ids=[],
        sample=[True] * batch,
        num_new_blocks=[0] * batch,
        new_blocks=[],
    )
    return pb, attn, plan


@pytest.mark.parametrize("batch", [1, 32, 256])
def test_bench_prepare_decode(benchmark, batch):
    pb, attn, plan = steady(batch)

    def prepare():
        inp = pb.prepare(plan, pad=True)
        return inp, attn.build(inp.layout, pb.column(SLOT_MAPPING, inp.num_rows))

    inp, meta = benchmark.pedantic(prepare, rounds=50 if batch > 1 else 200)
    assert inp.padded and inp.num_rows == padded_size(batch) and inp.num_sample == batch
    assert meta.all_decode and meta.decode_pages.shape == (inp.num_rows, 32)
    pos = np.asarray(plan.start_pos)
    assert pb.column(POSITIONS, batch).tolist() == plan.start_pos
    # each decode writes its K/V into the block its position falls in (setup's block ids)
    per_seq = -(-(CONTEXT + 1) // BLOCK)
    want = (1 + np.arange(batch) * per_seq + pos // BLOCK) * BLOCK + pos % BLOCK
    assert pb.column(SLOT_MAPPING, batch).tolist() == want.tolist()
