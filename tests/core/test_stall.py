"""core/stall.py: a step whose result is owed past max(--stall-timeout, 8 x the slowest recent
one) is a stall; the engine core counts it once, the next result ends it."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry

from gapless.common.messages import SamplingParams
from gapless.core.metrics import CoreMetrics
from gapless.core.stall import FACTOR, KEEP, StallWatch
from gapless.gpu_runner.sim.backend import SimBackend
from tests.conftest import sim_config
from tests.engine_harness import Harness


def test_nothing_owed_is_never_a_stall():
    watch = StallWatch(floor_s=5.0)
    assert watch.overdue_s(1e9) == 0.0
    watch.owed(100.0)
    watch.result(100.5, more=False)
    assert watch.overdue_s(1e9) == 0.0, "nothing in flight since the result"
    assert watch.stalls == 0


def test_the_bound_is_the_floor_or_the_slowest_recent_step_times_the_factor():
    watch = StallWatch(floor_s=5.0)
    watch.owed(0.0)
    assert watch.bound_s == 5.0, "no step seen yet: the floor"
    assert watch.overdue_s(4.9) == 0.0
    assert watch.overdue_s(5.1) == pytest.approx(5.1)
    assert watch.stalls == 1
    assert watch.overdue_s(7.0) == pytest.approx(7.0) and watch.stalls == 1, "one stall, once"
    assert watch.result(8.0, more=True) == pytest.approx(8.0), "the stall ended after 8 s"
    # the 8 s step is now the slowest recent one: the next may take 8 x 8 s
    assert watch.bound_s == pytest.approx(FACTOR * 8.0)
    assert watch.overdue_s(8.0 + 60.0) == 0.0
    for k in range(KEEP):  # the slow one ages out of the window
        watch.result(8.0 + (k + 1) * 0.01, more=True)
    assert watch.bound_s == 5.0


def test_a_result_starts_the_wait_for_the_next_step_in_flight():
    watch = StallWatch(floor_s=1.0)
    watch.owed(0.0)
    watch.owed(0.5)  # a second step sent while the first is owed: the wait runs on from 0
    assert watch.overdue_s(1.2) == pytest.approx(1.2)
    watch.result(1.3, more=True)  # the first came; the second is owed from now
    assert watch.overdue_s(1.3 + 0.9 * watch.bound_s) == 0.0


def test_the_engine_core_reports_counts_and_ends_a_stall(default_gguf):
    cfg = sim_config(default_gguf, max_num_seqs=4, max_num_batched_tokens=64, stall_timeout_s=2.0)
    metrics = CoreMetrics(CollectorRegistry())
    h = Harness(cfg, backend=SimBackend(cfg), metrics=metrics)
    h.run({0: [("a", list(range(1000, 1040)), SamplingParams(max_tokens=8))]})
    assert h.core.stall.usual_s > 0.0, "results were timed"
    h.add("b", list(range(1000, 1040)), SamplingParams(max_tokens=8))
    out = h.core.step(None)  # planned and sent; the runner never answers
    assert out.plans and h.core.inflight
    now = time.monotonic()
    assert h.core.overdue_s(now) == 0.0
    assert h.core.overdue_s(now + 3.0) > 2.0
    assert h.core.overdue_s(now + 4.0) > 3.0
    assert metrics.stalls._value.get() == 1
    # the result comes: no longer stalled
    result = h.backend.collect(h.backend.launch(out.plans[0]))
    h.core.step(result)
    assert h.core.overdue_s(time.monotonic()) == 0.0
