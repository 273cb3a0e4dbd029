"""Decode batches padded to capture sizes give the same tokens as unpadded ones, and their dummy
entries touch only block 0. The cpu device runs the graph layer eagerly, so this is the code
cuda replays."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gapless.common.messages import NewSlot, SamplingParams, StepPlan
from gapless.gpu_runner.batch import IDS, LOGIT_ROWS, SLOT_MAPPING, PersistentBatch
from gapless.gpu_runner.cpu.backend import CpuBackend
from gapless.gpu_runner.graph import capture_sizes, padded_size
from tests.engine_harness import Harness, make_config

GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
BLOCKS_PER_SLOT = 8  # slot s owns blocks 1 + s * 8 ..


@pytest.mark.parametrize(
    "max_num_seqs, want",
    [
        (1, [1]),
        (3, [1, 2, 4]),
        (8, [1, 2, 4, 8]),
        (9, [1, 2, 4, 8, 16]),
        (64, [1, 2, 4, 8, 16, 32, 48, 64]),
        (70, [1, 2, 4, 8, 16, 32, 48, 64, 80]),
    ],
)
def test_capture_sizes(max_num_seqs, want):
    assert capture_sizes(max_num_seqs) == want


def test_padded_size():
    assert [padded_size(b) for b in (1, 2, 3, 5, 8, 9, 16, 17, 33, 256)] == [
        1, 2, 4, 8, 8, 16, 16, 32, 48, 256
    ]  # fmt: skip
    for m in (1, 5, 13, 64, 100, 256):
        sizes = capture_sizes(m)
        assert all(padded_size(b) in sizes for b in range(1, m + 1))


class Plans:
    """Hand-made step plans: new slots prefill their whole prompt, then decode."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.seq = 0
        self.length: dict[int, int] = {}  # tokens in each slot's cache after the last plan
        self.blocks: dict[int, int] = {}

    def step(
        self, prompts: dict[int, list[int]], decodes: list[int], given: dict[int, int] | None = None
    ) -> StepPlan:
        """`given`: decode slots fed this token rather than the one the runner sampled last."""
        self.seq += 1
        given = given or {}
        entries = [(s, len(p), p) for s, p in prompts.items()]
        entries += [(s, 1, [given[s]] if s in given else None) for s in decodes]
        plan = StepPlan(
            seq=self.seq,
            new_slots=[
                NewSlot(slot=s, params=GREEDY, num_prompt_tokens=len(p)) for s, p in prompts.items()
            ],
            freed_slots=[],
            slots=[e[0] for e in entries],
            num_tokens=[e[1] for e in entries],
            start_pos=[self.length.get(e[0], 0) for e in entries],
            has_tokens=[e[2] is not None for e in entries],
            token_ids=[t for e in entries if e[2] is not None for t in e[2]],
            sample=[True] * len(entries),
            num_new_blocks=[],
            new_blocks=[],
        )
        for slot, n, _ in entries:
            end = self.length.get(slot, 0) + n
            have = self.blocks.get(slot, 0)
            need = -(-end // self.block_size) - have
            plan.num_new_blocks.append(need)
            plan.new_blocks.extend(1 + slot * BLOCKS_PER_SLOT + have + i for i in range(need))
            self.length[slot], self.blocks[slot] = end, have + need
        return plan


def forward_plan(backend, plan: StepPlan):
    """A backend's step up to the logits: (inputs, [B_s, vocab] logits of the sampling rows)."""
    step = backend.executor
    step.begin(plan)
    inp, meta = step.prepare(plan)
    return inp, step.run_model(inp, meta)


def _run(runner: CpuBackend, plans: list[StepPlan]) -> tuple[list, list]:
    tokens, logits = [], []
    with torch.inference_mode():
        for plan in plans:
            inp, step_logits = forward_plan(runner, plan)
            logits.append(step_logits.clone())
            tokens.append(runner.executor.sample(inp, step_logits).token_ids.tolist())
    return tokens, logits


def _plans(num_requests: int, block_size: int, num_decodes: int) -> list[StepPlan]:
    gen = torch.Generator().manual_seed(num_requests)
    lengths = torch.randint(1, 12, (num_requests,), generator=gen).tolist()
    prompts = {
        s: torch.randint(3, 40000, (n,), generator=gen).tolist() for s, n in enumerate(lengths)
    }
    maker = Plans(block_size)
    slots = list(prompts)
    return [maker.step(prompts, [])] + [maker.step({}, slots) for _ in range(num_decodes)]


@pytest.fixture(scope="module")
def runners(tiny_model_dir):
    config = make_config(tiny_model_dir, block_size=4, max_num_seqs=16)
    return lambda pad: CpuBackend(config, use_graphs=pad)


@pytest.mark.parametrize("num_requests", [3, 5, 9, 16])
def test_padded_decode_equals_unpadded(runners, num_requests):
    padded, plain = runners(True), runners(False)
    plans = _plans(num_requests, 4, num_decodes=6)  # contexts cross block boundaries
    calls = []
    run = padded.graphs.run
    padded.graphs.run = lambda size, meta: calls.append(size) or run(size, meta)
    tokens_p, logits_p = _run(padded, plans)
    tokens_u, logits_u = _run(plain, plans)
    assert calls == [padded_size(num_requests)] * 6
    assert tokens_p == tokens_u
    for got, want in zip(logits_p, logits_u, strict=True):
        assert got.shape == want.shape == (num_requests, padded.arch.vocab_size)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _cache(runner) -> torch.Tensor:  # [layers, 2, R, KVH, d], a copy
    return torch.stack([torch.stack(kv) for kv in runner.executor.kv_cache])


def test_dummies_write_only_block_zero(runners):
    runner = runners(True)
    bs = runner.config.block_size
    plans = _plans(3, bs, num_decodes=2)
    _run(runner, plans[:2])
    before = _cache(runner)
    _run(runner, plans[2:])
    changed = (before != _cache(runner)).flatten(3).any(-1).any(1).any(0)  # [rows] bool
    rows = np.flatnonzero(changed.numpy())
    real = runner.batch.column(SLOT_MAPPING, 3).numpy()
    dummy = runner.batch.column(SLOT_MAPPING, 4).numpy()[3:]
    assert set(rows) <= set(real) | set(range(bs)), "a step wrote outside its rows and block 0"
    assert set(real) <= set(rows) and (dummy < bs).all()
    assert runner.batch.column(IDS, 4)[3].item() == 0, "a dummy reads a fixed token"


def test_prepare_pads_only_decode_batches():
    batch = PersistentBatch(8, 4, 4, 32, "cpu")
    maker = Plans(4)
    for s in range(3):
        batch.add(s)
    first = batch.prepare(maker.step({0: [5, 6], 1: [7], 2: [8, 9, 10]}, []), pad=True)
    assert (
        not first.padded and first.num_rows == 6 and first.layout.num_tokens.tolist() == [2, 1, 3]
    )
    assert batch.column(LOGIT_ROWS, 3).tolist() == [1, 2, 5]
    inp = batch.prepare(maker.step({}, [0, 1, 2]), pad=True)
    assert inp.padded and inp.num_rows == 4 and inp.num_sample == 3
    assert inp.layout.num_tokens.tolist() == [1, 1, 1, 1]
    assert inp.layout.ctx_len.tolist() == [3, 2, 4, 1]
    assert inp.layout.page_table[3].tolist() == [0], "a dummy's context is block 0"
    assert batch.column(LOGIT_ROWS, 4).tolist() == [0, 1, 2, 0]
    assert batch.column(IDS, 4).tolist() == [-1, -1, -1, 0]
    plain = batch.prepare(maker.step({}, [0, 1, 2]), pad=False)
    assert not plain.padded and plain.num_rows == 3


def test_cpu_engine_runs_decodes_padded(tiny_model_dir):
    h = Harness(make_config(tiny_model_dir))
    assert h.backend.use_graphs, "the cpu device takes the padded path by default"
    sizes = []
    run = h.backend.graphs.run
    h.backend.graphs.run = lambda size, meta: sizes.append(size) or run(size, meta)
    short = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    arrivals = {0: [("r0", [11, 12, 13, 14], short)]}
    arrivals[1] = [(f"s{i}", [5 + i, 6, 7], short) for i in range(2)]
    got = h.run(arrivals)
    assert all(len(t) == 6 for t in got.values())
    assert sizes and set(sizes) <= {1, 2, 4}
    assert 4 in sizes, "three running requests decode as a batch of four"


def test_page_lists_for_flashinfer():
    """The CSR page table cuda plans from, built from the same layout as the torch path."""
    batch = PersistentBatch(8, 4, 4, 32, "cpu")
    maker = Plans(4)
    for s in range(3):
        batch.add(s)
    batch.prepare(maker.step({0: [1] * 4, 1: [2] * 5, 2: [3]}, []), pad=True)
    inp = batch.prepare(maker.step({}, [0, 1, 2]), pad=True)  # contexts 5, 6, 2 and a dummy
    indptr, indices, last = inp.layout.page_lists()
    assert indptr.tolist() == [0, 2, 4, 5, 6]
    assert indices.tolist() == [1, 2, 9, 10, 17, 0]
    assert last.tolist() == [1, 2, 2, 1]
    assert indptr.dtype == indices.dtype == last.dtype == np.int32


def test_a_verify_of_decodes_runs_as_padded_decode_rows_and_equals_unpadded(runners):
    """Decodes verifying drafts run as one decode row per token (each seeing the cache up to
    its own position) through the graph layer, padded; their logits equal the unpadded verify
    step's, which attends per entry with a causal mask."""
    prompts = {0: list(range(100, 105)), 1: list(range(200, 209)), 2: list(range(300, 308))}
    drafts = [[11, 12], [13], [14, 15, 16]]  # within each slot's blocks: 3 + 6 = 9 rows
    maker = Plans(4)
    prefill, verify = maker.step(prompts, []), maker.step({}, [0, 1, 2])
    got = {}
    for pad in (True, False):
        runner = runners(pad)
        ex, calls = runner.executor, []
        run = runner.graphs.run
        runner.graphs.run = lambda size, meta, run=run, calls=calls: (
            calls.append(size) or run(size, meta)
        )
        with torch.inference_mode():
            forward_plan(runner, prefill)
            ex.begin(verify)
            inp = ex.batch.prepare(verify, pad=ex.use_graphs, drafts=drafts)
            meta = ex.attn.build(inp.layout, ex.batch.column(SLOT_MAPPING, inp.num_rows))
            got[pad] = (inp, ex.run_model(inp, meta)[: inp.num_sample].clone(), calls)
    (inp_p, logits_p, calls_p), (inp_u, logits_u, calls_u) = got[True], got[False]
    assert inp_p.padded and inp_p.num_rows == padded_size(9) and calls_p == [16]
    assert not inp_u.padded and inp_u.num_rows == 9 and calls_u == []
    positions = [5, 6, 7, 9, 10, 8, 9, 10, 11]
    assert inp_p.layout.ctx_len[:9].tolist() == [p + 1 for p in positions]
    assert inp_p.sample_counts.tolist() == inp_u.sample_counts.tolist() == [3, 2, 4]
    torch.testing.assert_close(logits_p, logits_u, atol=1e-5, rtol=1e-5)
