"""Scheduling policies behind the scheduler: order, fair share, priority preemption, aging."""

from __future__ import annotations

import time
import zlib

import numpy as np

from gapless.common.messages import AddRequest, SamplingParams
from gapless.core.policy import FairPolicy, Policy, PriorityPolicy, make_policy
from gapless.core.scheduler import Scheduler
from tests.core.test_scheduler import fake_result, make_scheduler


def add(s: Scheduler, rid: str, tenant: str = "", priority: int = 0, prompt=8, out=8):
    return s.add_request(
        AddRequest(
            request_id=rid,
            frontend_id=0,
            # distinct first ids: the requests share no prefix-cache block
            prompt_token_ids=[100 + zlib.crc32(rid.encode()) % 30000]
            + list(range(11, 10 + prompt)),
            params=SamplingParams(max_tokens=out),
            arrival_time=time.time(),
            tenant=tenant,
            priority=priority,
        )
    )


def admitted(s: Scheduler) -> list[str]:
    """Plan one step and return the ids it admits."""
    step = s.schedule()
    new = {n.slot for n in step.plan.new_slots}
    s.update_from_output(step, fake_result(step))
    return [r.request_id for r in s.running if r.slot in new]


def test_fcfs_admits_in_arrival_order():
    s = make_scheduler(max_num_seqs=2, policy=Policy())
    for i, tenant in enumerate("aab"):
        add(s, f"r{i}", tenant, priority=-i)
    assert admitted(s) == ["r0", "r1"]


def test_priority_orders_classes_then_arrival():
    s = make_scheduler(max_num_seqs=3, policy=PriorityPolicy())
    add(s, "batch", priority=10)
    add(s, "default1")
    add(s, "interactive", priority=-10)
    add(s, "default2")
    assert admitted(s) == ["interactive", "default1", "default2"]


def test_fair_takes_the_least_served_tenant_and_keeps_each_tenants_order():
    s = make_scheduler(max_num_seqs=1, policy=FairPolicy())
    for i in range(3):
        add(s, f"a{i}", "a")
    add(s, "b0", "b")
    add(s, "b1", "b")
    order = []
    while s.has_work:
        order += admitted(s)
    # a0 is charged as it runs, so b goes next; then they alternate, each in its own order
    assert order == ["a0", "b0", "a1", "b1", "a2"]


def test_weights_scale_the_charge():
    p = FairPolicy(weights={"heavy": 2.0}, output_weight=2.0)
    heavy, light = p.tenant_id("heavy"), p.tenant_id("light")
    p.charge_outputs(np.asarray([heavy, heavy, light, light]))
    assert p.counters[heavy] == 2.0 and p.counters[light] == 4.0  # 2 tokens x 2 / weight


def test_a_tenant_back_from_idle_banks_no_credit():
    s = make_scheduler(max_num_seqs=1, policy=FairPolicy())
    add(s, "a0", "a", out=30)
    add(s, "a1", "a")
    assert admitted(s) == ["a0"]
    for _ in range(10):  # a is served and charged while b is idle
        admitted(s)
    policy = s.policy
    a, b = policy.tenant_id("a"), policy.tenant_id("b")
    add(s, "b0", "b")
    assert policy.counters[b] == policy.counters[a] > 0, "lifted to the backlogged minimum"


def test_prompt_is_charged_once_even_after_preemption():
    s = make_scheduler(num_blocks=7, block_size=4, max_num_seqs=2, policy=FairPolicy())
    add(s, "a", "a", prompt=8, out=12)
    add(s, "b", "b", prompt=8, out=12)
    for _ in range(30):
        if not s.has_work:
            break
        step = s.schedule()
        s.update_from_output(step, fake_result(step))
    assert s.num_preemptions > 0
    policy = s.policy
    served = {t: policy.counters[policy.tenant_id(t)] for t in "ab"}
    # 8 prompt tokens charged once, 12 outputs at 2 each; the recompute is free
    assert served == {"a": 8 + 12 * 2, "b": 8 + 12 * 2}


def test_interactive_preempts_the_lowest_class_newest_first():
    s = make_scheduler(max_num_seqs=2, policy=make_policy("fair"))
    add(s, "batch-old", priority=10, out=20)
    add(s, "batch-new", priority=10, out=20)
    assert admitted(s) == ["batch-old", "batch-new"]
    vip = add(s, "vip", priority=-10)
    assert admitted(s) == ["vip"]
    assert [r.request_id for r in s.waiting] == ["batch-new"], "it keeps its place in line"
    while s.has_work:
        admitted(s)
    assert vip.finished and s.num_preemptions == 1


def test_fcfs_never_preempts_for_priority():
    s = make_scheduler(max_num_seqs=1, policy=Policy())
    add(s, "batch", priority=10, out=20)
    admitted(s)
    add(s, "vip", priority=-10)
    assert admitted(s) == [] and s.num_preemptions == 0


def test_aging_bounds_the_wait_of_the_lowest_class():
    now = [0.0]
    s = make_scheduler(max_num_seqs=1, policy=PriorityPolicy(aging_s=5.0, clock=lambda: now[0]))
    old = add(s, "batch", priority=10)
    old.queued_at = 0.0
    add(s, "first", priority=0).queued_at = 0.0
    assert admitted(s) == ["first"]
    while s.running:  # "first" runs to its end; a newer interactive request waits too
        now[0] += 1.0
        if now[0] == 2.0:
            add(s, "vip", priority=-10).queued_at = now[0]
        admitted(s)
        if now[0] > 6:
            break
    assert s.policy.peek() is old, "waited past the aging bound: next, whatever its class"
    assert s.policy.num_aged == 0
    while old.status.name == "WAITING":
        admitted(s)
    assert s.policy.num_aged == 1, "its admission counts as an aged decision"


def test_a_tenant_with_requests_running_is_not_idle():
    """Its next request arriving after the last one got a seat is no return from idle."""
    s = make_scheduler(max_num_seqs=2, policy=FairPolicy())
    add(s, "a0", "a", out=30)
    add(s, "b0", "b", prompt=40, out=30)  # b is charged 32 prompt tokens more than a
    add(s, "b1", "b")
    assert admitted(s) == ["a0", "b0"]
    for _ in range(5):
        admitted(s)
    policy = s.policy
    a, b = policy.tenant_id("a"), policy.tenant_id("b")
    before = policy.counters[a]
    assert policy.counters[b] > before
    add(s, "a1", "a")  # a's queue was empty, but a0 runs: a is not idle, keeps its counter
    assert policy.counters[a] == before, "a lift would have raised it to b's counter"


def test_a_preempted_old_request_does_not_retake_its_seat():
    """A victim that has lived past the aging bound comes back with a fresh wait, so the
    request it was preempted for runs, and the two do not trade the seat forever."""
    now = [0.0]
    for policy in (PriorityPolicy(aging_s=1.0, clock=lambda: now[0]), FairPolicy(aging_s=1.0)):
        policy.clock = lambda: now[0]
        s = make_scheduler(max_num_seqs=1, policy=policy)
        batch = add(s, "batch", priority=10, prompt=40, out=30)
        batch.queued_at = now[0]  # joined the queue at 0 on the test's clock
        admitted(s)
        now[0] += 5.0  # the batch request is far past the aging bound
        vip = add(s, "vip", priority=-10)
        assert admitted(s) == ["vip"]
        while s.has_work:
            now[0] += 0.01
            admitted(s)
        assert vip.finished and batch.finished and s.num_preemptions == 1
        assert len(batch.output_ids) == 30, "the victim loses nothing"
