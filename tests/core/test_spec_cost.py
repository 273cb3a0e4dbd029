"""Speculation that knows when to stop (core/spec_cost.py): k per step from the device's step
time by tokens and the acceptance seen; drafts stop where verify rows would make a big batch
compute-bound. On sim (h100-llama3-8b's modelled table) and in the scheduler's plans."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from gapless.common.messages import SamplingParams
from gapless.common.step_costs import table_sizes
from gapless.core.metrics import CoreMetrics
from gapless.core.spec_cost import SpecCost
from gapless.gpu_runner.sim.profiles import get_profile, step_costs
from tests.conftest import sim_config
from tests.core.test_scheduler import fake_result, make_requests, make_scheduler
from tests.engine_harness import Harness

H100 = step_costs(get_profile("h100-llama3-8b"), 8192)  # (tokens, seconds), sim


def test_k_stays_while_memory_bound_and_goes_to_0_where_verify_rows_make_it_compute_bound():
    cost = SpecCost(*H100)
    ks = [cost.best_k(b, b, 0, 4) for b in (1, 8, 32, 64, 128, 256, 512)]
    assert ks[0] == ks[1] == 4
    assert ks == sorted(ks, reverse=True)  # more rows, fewer drafts
    assert ks[-2] == ks[-1] == 0
    # beside a long prompt chunk, 4 rows' drafts add little to a step that costs as much anyway
    assert cost.best_k(4, 4 + 2048, 0, 4) == 4
    assert cost.num_stopped >= 2


def test_the_acceptance_seen_moves_k():
    low, high = SpecCost(*H100), SpecCost(*H100)
    low.observe(np.full(200, 4), np.zeros(200, np.int64))  # every first draft rejected
    high.observe(np.full(200, 4), np.full(200, 4))
    assert low.acceptance < 0.05 < 0.95 < high.acceptance
    prior = SpecCost(*H100)
    for b in (1, 8, 32, 64, 128, 256):
        assert low.best_k(b, b, 0, 4) <= prior.best_k(b, b, 0, 4) <= high.best_k(b, b, 0, 4)
    assert low.best_k(8, 8, 0, 4) < 4 and low.best_k(128, 128, 0, 4) == 0
    assert high.best_k(128, 128, 0, 4) > 0


def test_tables_that_say_always_and_never():
    sizes = table_sizes(512)
    assert sizes == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512] and table_sizes(48)[-1] == 48
    flat = SpecCost(sizes, [0.01] * len(sizes))  # bound by memory at every size
    linear = SpecCost(sizes, [0.001 * n for n in sizes])  # every token costs the same
    assert flat.best_k(8, 8, 0, 4) == 4 and linear.best_k(1, 1, 0, 4) == 0
    assert SpecCost().best_k(512, 512, 0, 4) == 4  # no table (cuda): k as asked
    noisy = SpecCost([1, 2, 4], [0.02, 0.01, 0.03])  # a run slowed by other work: bounded
    assert list(noisy.seconds) == [0.01, 0.01, 0.03]


def _decode_plan(num_requests: int, steps: int = 1):
    s = make_scheduler(num_blocks=4096, block_size=16, max_num_seqs=256,
                       max_num_batched_tokens=2048, speculative="ngram",
                       num_speculative_tokens=4, step_costs=H100)  # fmt: skip
    make_requests(s, num_requests, max_tokens=32)
    step = s.schedule()
    assert step is not None and step.num_prefill_tokens == 6 * num_requests
    s.update_from_output(step, fake_result(step))
    for _ in range(steps):
        step = s.schedule()
        assert step is not None and step.num_decode_tokens == num_requests
        s.update_from_output(step, fake_result(step))
    return step


def test_the_scheduler_plans_drafts_for_few_rows_and_none_for_many():
    few = _decode_plan(4)
    # the decode plan, verifying on counts
    assert few.plan.num_draft == [4] * 4 and few.decode is not None and few.drafts is not None
    many = _decode_plan(256, steps=3)
    # no drafts: the steady-decode path, as without speculation
    assert not any(many.plan.num_draft) and many.decode is not None


def _sim_run(model_dir, streams: int, spec: str, max_tokens: int):
    cfg = sim_config(model_dir, sim_profile="h100-llama3-8b", max_num_seqs=streams,
                     max_num_batched_tokens=8192, speculative=spec, num_speculative_tokens=4,
                     sim_time_scale=0.05)  # fmt: skip
    registry = CollectorRegistry()
    h = Harness(cfg, metrics=CoreMetrics(registry=registry))
    params = SamplingParams(max_tokens=max_tokens)
    h.run({0: [(f"r{i}", list(range(100 + i, 120 + i)), params) for i in range(streams)]})
    assert all(len(ids) == max_tokens for ids in h.outputs.values())  # max_tokens holds
    assert (h.scheduler.rb.spec_extra == 0).all()
    drafted = registry.get_sample_value("gapless_spec_draft_tokens_total", {"method": "ngram"})
    return h, drafted or 0.0


def test_sim_verifies_at_the_profiles_acceptance_and_stops_for_a_big_batch(tiny_model_dir):
    on, drafted = _sim_run(tiny_model_dir, 8, "ngram", 32)
    assert drafted > 0 and on.steps < 32 * 0.8  # off: a prefill step, then one per token
    accepted = on.scheduler.spec_cost.acceptance
    assert abs(accepted - get_profile("h100-llama3-8b").spec_acceptance) < 0.1
    big, drafted = _sim_run(tiny_model_dir, 256, "ngram", 8)
    assert drafted == 0 and big.scheduler.spec_cost.num_stopped > 0


def test_past_the_table_a_token_costs_at_least_the_mean_of_the_largest_size():
    """A last segment measured flat does not make many rows' drafts look free: past the
    table's end each token costs at least what one did on average at its largest size."""
    cost = SpecCost([1, 2, 32, 64], [0.007, 0.009, 0.0470, 0.0475])
    assert cost.step_seconds(np.array([128]))[0] == pytest.approx(0.0475 * 2)
    cost.observe(np.full(1, 10_000), np.full(1, 7_000))
    cost.accepted, cost.rejected = 7_000.0, 3_000.0
    assert cost.best_k(32, 32, 0, 4) <= 1  # 32 rows: a draft or none, not four
