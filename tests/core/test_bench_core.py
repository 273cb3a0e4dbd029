"""Benchmarks of the core's per-step hot paths in steady decode: planning and applying."""

from __future__ import annotations

import pytest

from gapless.common.messages import StepResult
from gapless.core.policy import make_policy
from tests.core.test_scheduler import make_requests, make_scheduler

SIZES = [1, 32, 256]


def steady(batch: int, policy: str = "fcfs"):
    s = make_scheduler(
        num_blocks=batch * 40 + 1,
        block_size=16,
        max_num_seqs=batch,
        max_num_batched_tokens=max(512, batch),
        max_model_len=4096,
        policy=make_policy(policy),
    )
    make_requests(s, batch, prompt_len=16, max_tokens=3000)
    while s.waiting or any(s.rb.computed[r.slot] < 16 for r in s.running):  # the prompts
        step = s.schedule()
        s.update_from_output(step, _result(step))
    return s


def _result(step) -> StepResult:
    return StepResult(seq=step.plan.seq, token_ids=[7] * len(step.sampled))


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
@pytest.mark.parametrize("batch", SIZES)
def test_bench_core_plan(benchmark, batch, policy):
    s = steady(batch, policy)
    box = {}

    def apply_previous():
        if "step" in box:
            s.update_from_output(box["step"], _result(box["step"]))

    def plan():
        box["step"] = s.schedule()

    benchmark.pedantic(plan, setup=apply_previous, rounds=50 if batch > 1 else 200)
    assert len(box["step"].plan.slots) == batch and not any(box["step"].plan.has_tokens)


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
@pytest.mark.parametrize("batch", SIZES)
def test_bench_core_apply(benchmark, batch, policy):
    s = steady(batch, policy)
    box = {}

    def plan_next():
        box["step"] = s.schedule()
        box["result"] = _result(box["step"])

    def apply():
        box["out"] = s.update_from_output(box["step"], box["result"])

    benchmark.pedantic(apply, setup=plan_next, rounds=50 if batch > 1 else 200)
    out = box["out"]
    assert len(out.requests) == batch and out.token_ids == [7] * batch
    assert out.end_reasons == [""] * batch, "3000-token budgets: nobody ends here"


def _distinct_run(caching: bool, prompts: list[list[int]], hashes: list[list[bytes]]):
    """Every request of a 0%-hit run through the scheduler with fake results: the core's
    schedule + apply work for the whole run. Hashes come named, as the frontend sends them."""
    import time

    from gapless.common.messages import AddRequest, SamplingParams

    s = make_scheduler(
        num_blocks=64 * 80 + 1,
        block_size=16,
        max_num_seqs=64,
        max_num_batched_tokens=8192,
        max_model_len=4096,
        policy=make_policy("fair"),
        prefix_caching=caching,
    )
    for i, (p, h) in enumerate(zip(prompts, hashes, strict=True)):
        s.add_request(
            AddRequest(f"r{i}", 0, p, SamplingParams(max_tokens=16), time.time(),
                       block_hashes=h if caching else [])
        )  # fmt: skip
    steps = 0
    while (step := s.schedule()) is not None:
        s.update_from_output(step, _result(step))
        steps += 1
    assert s.num_hit_tokens == 0 and not s.has_work
    return steps


@pytest.mark.parametrize("caching", [False, True], ids=["caching-off", "caching-on"])
def test_bench_core_run_of_distinct_prompts(benchmark, caching):
    """128 requests of 1,024 distinct prompt tokens and 16 outputs: compare on and off."""
    import numpy as np

    from gapless.common.block_hash import chain_hashes, hash_root

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 40000, 1024).tolist() for _ in range(128)]
    hashes = [chain_hashes(hash_root("", ""), p, 16) for p in prompts]
    steps = benchmark.pedantic(_distinct_run, args=(caching, prompts, hashes), rounds=7)
    assert steps > 16
