"""The scheduler alone, with fake runner results."""

from __future__ import annotations

import time

import pytest

from gapless.common.messages import (
    AddRequest,
    PromptLogprobs,
    SampleLogprobs,
    SamplingParams,
    StepResult,
)
from gapless.core.scheduler import ScheduledStep, Scheduler

EOS = 2


def make_scheduler(**overrides) -> Scheduler:
    kw = dict(
        num_blocks=64,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=128,
        eos_token_ids=(EOS,),
    )
    kw.update(overrides)
    return Scheduler(**kw)


def make_requests(sched: Scheduler, n: int, prompt_len: int = 6, **params) -> list:
    """n requests with distinct prompts (they share no prefix-cache block)."""
    params.setdefault("max_tokens", 8)
    return [
        sched.add_request(
            AddRequest(
                request_id=f"r{i}",
                frontend_id=0,
                prompt_token_ids=[100 + i] + list(range(11, 10 + prompt_len)),
                params=SamplingParams(**params),
                arrival_time=time.time(),
            )
        )
        for i in range(n)
    ]


def fake_result(step: ScheduledStep, token: int | dict = 7) -> StepResult:
    ids = [token.get(r.request_id, 7) if isinstance(token, dict) else token for r in step.sampled]
    return StepResult(seq=step.plan.seq, token_ids=ids)


def test_decode_entries_read_the_device_and_prefill_carries_ids():
    s = make_scheduler()
    make_requests(s, 2)
    first = s.schedule()
    assert first.plan.has_tokens == [True, True] and first.plan.num_tokens == [6, 6]
    assert len(first.plan.token_ids) == 12 and first.plan.sample == [True, True]
    second = s.schedule()  # planned before the first result: overlap
    assert second.plan.has_tokens == [False, False] and second.plan.token_ids == []
    assert second.plan.start_pos == [6, 6] and second.plan.seq == first.plan.seq + 1


def test_eos_under_overlap_drops_the_extra_token_and_frees_once():
    s = make_scheduler()
    (req,) = make_requests(s, 1)
    idle_free = s.blocks.num_free
    a, b = s.schedule(), s.schedule()  # b already contains req's next decode
    out = s.update_from_output(a, fake_result(a, EOS))
    assert out.end_reasons == ["stop_token"] and req.finished
    assert s.blocks.num_free == idle_free, "blocks come back as soon as the stop is seen"
    out = s.update_from_output(b, fake_result(b, 9))
    assert out.requests == [], "the token past EOS never leaves the core"
    assert req.output_ids == [EOS] and "r0" not in s.requests
    c = s.schedule()  # the freed slot is announced to the runner
    assert c is not None and c.plan.freed_slots == [0] and c.plan.slots == []


def test_max_tokens_costs_no_extra_step():
    s = make_scheduler()
    make_requests(s, 1, max_tokens=2)
    a, b = s.schedule(), s.schedule()
    assert s.schedule() is None, "both allowed samples are in flight: nothing more to plan"
    s.update_from_output(a, fake_result(a))
    out = s.update_from_output(b, fake_result(b))
    assert out.end_reasons == ["length"]


def test_abort_and_stop_hit_free_blocks_once():
    s = make_scheduler()
    reqs = make_requests(s, 3)
    step = s.schedule()
    assert s.finish(reqs[0], "abort") is True
    assert s.finish(reqs[0], "abort") is False, "a second finish is a no-op"
    s.finish(reqs[1], "stop")
    out = s.update_from_output(step, fake_result(step))
    assert [r.request_id for r in out.requests] == ["r2"]
    s.finish(reqs[2], "abort")
    assert s.blocks.num_free == s.blocks.num_usable and not s.has_work


def test_waiting_request_aborted_before_it_ran():
    s = make_scheduler(max_num_seqs=1)
    reqs = make_requests(s, 2)
    s.schedule()
    assert s.finish(reqs[1], "abort") and list(s.waiting) == []


def test_chunked_prefill_respects_the_budget_and_mixes_with_decodes():
    s = make_scheduler(max_num_batched_tokens=8)
    make_requests(s, 1, prompt_len=4)
    first = s.schedule()
    s.update_from_output(first, fake_result(first))
    make_requests_named(s, "long", 20)
    step = s.schedule()
    assert step.plan.num_tokens == [1, 7] and step.plan.sample == [True, False]
    assert sum(step.plan.num_tokens) <= 8


def make_requests_named(s, rid, prompt_len):
    return s.add_request(
        AddRequest(
            request_id=rid,
            frontend_id=0,
            prompt_token_ids=list(range(prompt_len)),
            params=SamplingParams(max_tokens=4),
            arrival_time=0.0,
        )
    )


@pytest.mark.parametrize("caching", [False, True])
def test_preemption_recomputes_the_newest_and_keeps_its_place(caching):
    s = make_scheduler(num_blocks=7, block_size=4, prefix_caching=caching)  # 6 usable blocks
    # 2 blocks each at admission, 5 at most: both fit the cache alone, not together
    reqs = make_requests(s, 2, prompt_len=8, max_tokens=12)
    for _ in range(12):
        step = s.schedule()
        s.update_from_output(step, fake_result(step))
        if s.num_preemptions:
            break
    assert s.num_preemptions >= 1
    assert s.waiting[0] is reqs[1], "the newest is preempted and waits first in line"
    known = reqs[1].num_tokens
    # once it runs again, its whole known sequence is recomputed with ids from the host
    for _ in range(20):
        step = s.schedule()
        assert step is not None, "the preempted request must come back"
        if reqs[1] in step.sampled:
            break
        s.update_from_output(step, fake_result(step))
    j = step.plan.slots.index(reqs[1].slot)
    start = step.plan.start_pos[j]
    assert step.plan.has_tokens[j] and start + step.plan.num_tokens[j] == known
    if caching:  # the blocks it left behind stayed cached: it recomputes only past them
        assert start > 0 and start % 4 == 0
    else:
        assert start == 0, "prompt and every known output, in one chunk"


def test_request_that_can_never_fit_is_reported():
    s = make_scheduler(num_blocks=3, block_size=4)
    (req,) = make_requests(s, 1, prompt_len=30)
    assert "KV cache" in s.fits_ever(req)


def test_a_context_of_2_32_keeps_output_ids_for_what_the_cache_holds():
    """A slot's output ids are bounded by the KV blocks (a sequence never holds more), not by
    the context the model declares: 2^32 - 1 of them per slot was 275 GB here."""
    s = make_scheduler(num_blocks=7, block_size=4, max_model_len=2**32 - 1)
    assert s.rb.out.shape == (8, 6 * 4)
    (req,) = make_requests(s, 1, prompt_len=6, max_tokens=18)  # 24 tokens: the whole cache
    assert s.fits_ever(req) is None
    while not req.finished:
        step = s.schedule()
        s.update_from_output(step, fake_result(step))
    assert len(req.output_ids) == 18


def test_one_truth_while_running_preempted_and_finished():
    """A request's ids read the same through the Request wherever they live."""
    s = make_scheduler(num_blocks=7, block_size=4)
    reqs = make_requests(s, 2, prompt_len=8, max_tokens=12)
    sampled: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    token = iter(range(100, 10_000))
    while not s.num_preemptions:
        step = s.schedule()
        ids = {r.request_id: next(token) for r in step.sampled}
        out = s.update_from_output(step, fake_result(step, ids))
        for r, t in zip(out.requests, out.token_ids, strict=True):
            sampled[r.request_id].append(t)
        for r in reqs:  # running: read from the batch's arrays
            assert r.output_ids == sampled[r.request_id]
    victim = reqs[1]
    assert victim.slot == -1 and victim.output_ids == sampled["r1"], "preempted: its own list"
    s.finish(reqs[0], "abort")
    assert reqs[0].output_ids == sampled["r0"], "finished: its ids went back with it"


def test_stop_token_and_length_end_preempted_requests_too():
    """A token that arrives after its request left the slot goes through the same checks."""
    s = make_scheduler(num_blocks=7, block_size=4)
    reqs = make_requests(s, 2, prompt_len=8, max_tokens=12, stop_token_ids=(55,))
    for _ in range(40):
        step = s.schedule()
        if reqs[1].num_pending and reqs[1] in step.sampled:
            s.preempt(reqs[1])  # its sample is in flight: it arrives off the slot
            out = s.update_from_output(step, fake_result(step, {"r1": 55}))
            break
        s.update_from_output(step, fake_result(step))
    else:
        raise AssertionError("r1 never had a sample in flight")
    j = [r.request_id for r in out.requests].index("r1")
    assert out.end_reasons[j] == "stop_token" and reqs[1].finished
    assert reqs[1].output_ids[-1] == 55 and "r1" not in s.requests


def test_length_ends_at_max_tokens_or_context():
    s = make_scheduler(max_model_len=12)
    first, second = make_requests(s, 2, prompt_len=8, max_tokens=10)  # context ends both
    ended: dict[str, str] = {}
    while s.has_work:
        step = s.schedule()
        out = s.update_from_output(step, fake_result(step))
        ended.update(
            {r.request_id: e for r, e in zip(out.requests, out.end_reasons, strict=True) if e}
        )
    assert ended == {"r0": "length", "r1": "length"}
    assert len(first.output_ids) == len(second.output_ids) == 4


def test_ignore_eos_ignores_eos_but_not_stop_token_ids():
    s = make_scheduler()
    make_requests(s, 2, max_tokens=8, ignore_eos=True, stop_token_ids=(55,))
    step = s.schedule()
    out = s.update_from_output(step, fake_result(step, {"r0": EOS, "r1": 55}))
    assert out.end_reasons == ["", "stop_token"]
    step = s.schedule()
    assert step.decode is not None, "r0 decodes alone: the decode plan"
    out = s.update_from_output(step, fake_result(step, {"r0": 55}))
    assert out.end_reasons == ["stop_token"] and not s.has_work


def scored_result(step: ScheduledStep, req) -> StepResult:
    """A fake result whose prompt chunk for `req` is scored as the runner scores it: rows
    begin .. begin + n - 1 score the prompt tokens after them."""
    (j,) = [j for j, s in enumerate(step.plan.slots) if s == step.plan.new_slots[0].slot]
    begin = step.plan.start_pos[j]
    ids = req.prompt_ids[begin + 1 : begin + step.plan.num_tokens[j] + 1]
    piece = PromptLogprobs(
        slot=step.plan.slots[j],
        start=begin + 1,
        token_ids=ids,
        logprobs=[SampleLogprobs(-float(t)) for t in ids],
    )
    return StepResult(seq=step.plan.seq, token_ids=[7] * len(step.sampled), prompt_logprobs=[piece])


@pytest.mark.parametrize("slot_reused", [False, True], ids=["slot-empty", "slot-reused"])
def test_prompt_scores_reach_a_request_preempted_while_they_were_in_flight(slot_reused):
    """A prompt chunk scored in a step belongs to the request it was planned for, even when
    that request left its slot (and another took it) before the result came back."""
    s = make_scheduler(max_num_seqs=1)  # one slot: the next request takes the same one
    (req,) = make_requests(s, 1, prompt_len=9, prompt_logprobs=1)
    step = s.schedule()
    assert step.sampled == [req], "the whole prompt in one chunk, then its first sample"
    s.preempt(req)
    if slot_reused:
        make_requests_named(s, "other", 9)
        assert s.schedule().plan.new_slots[0].slot == step.plan.new_slots[0].slot
    out = s.update_from_output(step, scored_result(step, req))
    (sent,) = [p for r, p in zip(out.requests, out.prompt_logprobs, strict=True) if r is req]
    assert sent.token_ids == req.prompt_ids[1:]
    assert [x.logprob for x in sent.logprobs] == [-float(t) for t in req.prompt_ids[1:]]


def test_a_recompute_in_other_chunks_completes_the_prompt_scores():
    """Scores held up to token 8, then a recompute scores the prompt again in chunks that
    straddle that point: the part past it is joined, the repeats are not."""
    s = make_scheduler()
    (req,) = make_requests(s, 1, prompt_len=12, prompt_logprobs=1)
    ids = req.prompt_ids

    def piece(start: int, end: int) -> PromptLogprobs:
        return PromptLogprobs(
            0, start, ids[start:end], [SampleLogprobs(-t) for t in ids[start:end]]
        )

    for start, end in ((1, 8), (1, 5), (5, 10), (10, 12), (1, 12)):  # first chunk, then again
        req.add_prompt_logprobs(piece(start, end))
    held = req.take_prompt_logprobs()
    assert held.start == 1 and held.token_ids == ids[1:]
    assert [x.logprob for x in held.logprobs] == [-t for t in ids[1:]]
