"""Benchmarks of the core's per-step hot paths in steady decode: planning and applying."""

from __future__ import annotations

import pytest

from gapless.core.common.messages import StepResult
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
