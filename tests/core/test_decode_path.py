"""The steady-decode plan (Planner.plan_decode) against the general plan: the same steps,
outputs and accounting, over random workloads with overlap, preemption, stops and aborts."""

from __future__ import annotations

import time
import zlib
from collections import deque

import numpy as np
import pytest

from gapless.common.messages import AddRequest, SamplingParams, StepResult
from gapless.core.policy import make_policy
from tests.core.test_prefix_cache import check_blocks
from tests.core.test_scheduler import EOS, make_scheduler


def _token(rid: str, n: int) -> int:
    """The id sampled as a request's n-th output: the same in every run."""
    h = zlib.crc32(f"{rid}:{n}".encode())
    return EOS if h % 61 == 0 else 3 + h % 40


def _requests(rng: np.random.Generator, n: int) -> list[AddRequest]:
    shared = rng.integers(3, 50, 9).tolist()
    out = []
    for i in range(n):
        prompt = rng.integers(3, 50, int(rng.integers(1, 30))).tolist()
        if rng.random() < 0.3:  # a prefix other requests have too
            prompt = shared + prompt
        params = SamplingParams(
            max_tokens=int(rng.integers(1, 60)),
            ignore_eos=bool(rng.random() < 0.3),
            stop_token_ids=[int(rng.integers(3, 43))] if rng.random() < 0.2 else [],
            min_tokens=int(rng.integers(0, 3)),
        )
        tenant, priority = "abc"[i % 3], int(rng.random() < 0.2)
        out.append(AddRequest(f"r{i}", 0, prompt, params, time.time(), tenant, priority))
    return out


def _run(seed: int, general: bool, policy: str, depth: int, **config):
    """Every step's plan and output, and the accounting at the end; with `general`, the
    steady-decode plan is never taken. Also counts the steps it planned."""
    rng = np.random.default_rng(seed)
    arrivals = _requests(rng, 40)
    s = make_scheduler(policy=make_policy(policy), **config)
    decode_steps = [0, 0, 0]  # steps the decode plan made; with new blocks; with a row left out
    plan_decode = s.planner.plan_decode

    def counted(d):
        step = plan_decode(d)
        if step is not None:
            decode_steps[0] += 1
            decode_steps[1] += bool(step.plan.new_blocks)
            decode_steps[2] += len(step.plan.slots) < len(d.slot_list)
        return step

    s.planner.plan_decode = (lambda d: None) if general else counted
    inflight: deque = deque()
    log = []
    for _ in range(600):
        while arrivals and rng.random() < 0.3:
            s.add_request(arrivals.pop(0))
        if rng.random() < 0.02 and s.requests:  # a client goes away
            s.finish(s.requests[sorted(s.requests)[int(rng.integers(len(s.requests)))]], "abort")
        while len(inflight) < depth and (step := s.schedule()) is not None:
            inflight.append(step)
            log.append(step.plan)
        if inflight:
            step = inflight.popleft()
            out = s.update_from_output(step, _result(step))
            log.append(([r.request_id for r in out.requests], out.token_ids, out.end_reasons))
        check_blocks(s)
        if not arrivals and not inflight and not s.has_work:
            break
    assert not s.has_work and not inflight, "the run ends"
    p = s.policy
    accounts = [p.output_tokens.tolist(), p.prompt_tokens.tolist(), s.num_preemptions]
    if policy == "fair":
        accounts += [p.counters.tolist(), p.committed.tolist()]
    return log, accounts, decode_steps


def _result(step) -> StepResult:
    """The same ids in every run; a row that verifies d drafts accepts 0..d of them, as the
    hash of where it stands says."""
    if step.drafts is None:
        ids = [_token(r.request_id, len(r.output_ids)) for r in step.sampled]
        return StepResult(seq=step.plan.seq, token_ids=ids)
    ids, counts = [], []
    for r, d in zip(step.sampled, step.drafts.tolist(), strict=True):
        n = len(r.output_ids)
        count = 1 + zlib.crc32(f"{r.request_id}:{n}:a".encode()) % (d + 1)
        ids += [_token(r.request_id, n + i) for i in range(count)]
        counts.append(count)
    drafted = step.drafts.tolist()
    return StepResult(seq=step.plan.seq, token_ids=ids, counts=counts, num_drafted=drafted)


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize(
    "config",
    [
        dict(num_blocks=200, max_num_seqs=8, max_num_batched_tokens=64),
        dict(num_blocks=40, max_num_seqs=16, max_num_batched_tokens=12),  # preempts
        dict(num_blocks=120, max_num_seqs=32, max_num_batched_tokens=256, prefix_caching=False),
    ],
    ids=["roomy", "tight", "no-caching"],
)
def test_decode_plan_makes_the_steps_the_general_plan_makes(policy, depth, config):
    for seed in range(3):
        want, want_accounts, _ = _run(seed, True, policy, depth, **config)
        got, got_accounts, (num_decode, num_grown, num_left_out) = _run(
            seed, False, policy, depth, **config
        )
        assert len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g == w, f"seed {seed}, entry {i}"
        assert got_accounts == want_accounts
        assert num_decode > 0 and num_grown > 0, "the decode plan ran and grew blocks"
    assert num_left_out > 0 or depth == 1, "a request's last sample in flight was left out"


def test_staggered_requests_take_a_block_each_when_theirs_fill():
    s = make_scheduler(block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    for p in (4, 5, 6, 7):
        params = SamplingParams(max_tokens=20)
        s.add_request(AddRequest(f"p{p}", 0, list(range(10, 10 + p)), params, time.time()))
    step = s.schedule()
    s.update_from_output(step, StepResult(seq=step.plan.seq, token_ids=[7] * 4))
    for _ in range(8):
        step = s.schedule()
        assert step.decode is not None, "every request decodes: the decode plan"
        # a request computing position start writes a new block when start is a multiple of 4
        want = [int(pos % 4 == 0) for pos in step.plan.start_pos]
        assert step.plan.num_new_blocks == want and len(step.plan.new_blocks) == sum(want)
        s.update_from_output(step, StepResult(seq=step.plan.seq, token_ids=[7] * 4))
        for r in s.running:
            assert len(r.blocks) == -(-int(s.rb.computed[r.slot]) // 4)


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize(
    "config",
    [
        dict(num_blocks=200, max_num_seqs=8, max_num_batched_tokens=64),
        dict(num_blocks=40, max_num_seqs=16, max_num_batched_tokens=24),  # preempts
    ],
    ids=["roomy", "tight"],
)
def test_decode_plan_verifies_drafts_on_counts_as_the_general_plan_does(depth, config):
    """Rows that draft: the decode plan reserves 1 + k per row on top of the verifies in
    flight, and what each result accepts is reconciled, exactly as the general plan does."""
    spec = dict(speculative="ngram", num_speculative_tokens=3)
    num_verify = 0
    for seed in range(3):
        want, want_accounts, _ = _run(seed, True, "fair", depth, **config, **spec)
        got, got_accounts, (num_decode, _, _) = _run(seed, False, "fair", depth, **config, **spec)
        assert len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g == w, f"seed {seed}, entry {i}"
        assert got_accounts == want_accounts
        num_verify += sum(1 for e in got if hasattr(e, "num_draft") and any(e.num_draft))
        assert num_decode > 0
    assert num_verify > 0, "steps verified drafts"
