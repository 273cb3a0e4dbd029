"""Fair share between tenants and priorities, through the real EngineCore in-process with the
sim device (a100-llama-1.3b: short steps, sim) or the cpu runner where greedy outputs matter.
Time is counted in engine steps; tokens per tenant are those the detokenizer received."""

from __future__ import annotations

import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from gapless.bench.spec_tenants import run as run_spec_tenants
from gapless.common.config import TenantSpec
from gapless.common.messages import QUEUE_STATE_INTERVAL_S, QueueState, SamplingParams
from gapless.core.metrics import CoreMetrics
from tests.conftest import sim_config
from tests.engine_harness import Harness, make_config

PROMPT = list(range(2000, 2032))  # 32 tokens


def jain(x) -> float:
    x = np.asarray(x, float)
    return float(x.sum() ** 2 / (len(x) * (x**2).sum()))


def engine(default_gguf, policy: str, **overrides) -> Harness:
    fields = dict(sim_profile="a100-llama-1.3b", max_num_seqs=16, max_num_batched_tokens=512)
    return Harness(sim_config(default_gguf, scheduling_policy=policy, **{**fields, **overrides}))


def tenant_requests(tenant: str, n: int, outs, start: int = 0):
    """n requests of one tenant at step `start`; outs: one output length, or a list."""
    lens = outs if isinstance(outs, list) else [outs] * n
    return {
        start: [
            (f"{tenant}{start}-{i}", PROMPT, SamplingParams(max_tokens=lens[i]), tenant)
            for i in range(n)
        ]
    }


def merge(*arrivals: dict) -> dict:
    out: dict = {}
    for a in arrivals:
        for step, reqs in a.items():
            out.setdefault(step, []).extend(reqs)
    return out


def tokens_in(h: Harness, tenant: str, first: int, last: int) -> int:
    """Tokens the tenant received in steps [first, last)."""
    steps = [s for rid, ss in h.token_steps.items() if rid.startswith(tenant) for s in ss]
    return sum(first <= s < last for s in steps)


def all_backlogged(h: Harness, tenants: str, since: int = 0) -> tuple[int, int]:
    """The first and last+1 step from `since` at which every tenant had requests waiting."""
    both = [k for k, b in enumerate(h.backlogged) if k >= since and set(tenants) <= b]
    assert both, "the tenants were never backlogged together"
    return both[0], both[-1] + 1


def ttft(h: Harness, rid: str) -> int:
    return h.token_steps[rid][0] - h.arrived[rid]


def test_noisy_neighbor(default_gguf):
    outs = np.random.default_rng(0).integers(16, 65, 200).tolist()
    got = {}
    for policy in ("fcfs", "fair"):
        h = engine(default_gguf, policy, max_num_seqs=32)
        h.run(merge(tenant_requests("A", 200, outs), tenant_requests("B", 1, 32, start=10)))
        assert len(h.outputs["B10-0"]) == 32 and h.finish["B10-0"] == "length"
        got[policy] = ttft(h, "B10-0")
    print(f"noisy neighbor: B's TTFT fair {got['fair']} steps, fcfs {got['fcfs']} steps (sim)")
    assert got["fair"] <= 0.2 * got["fcfs"], got


def test_equal_tenants_share_equally(default_gguf):
    h = engine(default_gguf, "fair")
    h.run(merge(*(tenant_requests(t, 150, 48, start=20 * k) for k, t in enumerate("PQRS"))))
    first, last = all_backlogged(h, "PQRS")
    assert last - first > 50, "a window long enough to measure"
    received = [tokens_in(h, t, first, last) for t in "PQRS"]
    print(f"equal tenants: {received} tokens in {last - first} steps, Jain {jain(received):.4f}")
    assert jain(received) >= 0.99, received


def test_weights_two_to_one(default_gguf):
    tenants = {"H": TenantSpec(weight=2.0)}
    h = engine(default_gguf, "fair", tenants=tenants)
    h.run(merge(tenant_requests("H", 120, 48), tenant_requests("L", 120, 48)))
    first, last = all_backlogged(h, "HL")
    ratio = tokens_in(h, "H", first, last) / tokens_in(h, "L", first, last)
    print(f"weights 2:1: tokens received {ratio:.3f}:1 in {last - first} steps (sim)")
    assert 1.9 <= ratio <= 2.1, ratio


def test_a_returning_tenant_gets_no_more_than_its_share(default_gguf):
    h = engine(default_gguf, "fair")
    back = 300
    h.run(
        merge(
            tenant_requests("A", 300, 48),
            tenant_requests("B", 30, 48),  # B is served, drains, and stays away a while
            tenant_requests("B", 60, 48, start=back),  # then comes back with a backlog
        )
    )
    assert not any("B" in b for b in h.backlogged[back - 50 : back]), "B was idle"
    first, last = all_backlogged(h, "AB", since=back)
    last = min(last, first + 100)
    b, a = tokens_in(h, "B", first, last), tokens_in(h, "A", first, last)
    print(f"returning tenant: {b / (a + b):.3f} of the tokens in {last - first} steps after")
    assert b / (a + b) <= 0.55, (a, b)


def test_alone_fair_costs_nothing(default_gguf):
    steps, busy = {}, {}
    for policy in ("fcfs", "fair"):
        h = engine(default_gguf, policy)
        h.run(tenant_requests("A", 60, np.arange(16, 76).tolist()))
        steps[policy] = h.steps
        busy[policy] = h.core.timeline.summary().busy_s
    print(f"alone: steps {steps}, sim device busy s {busy}")
    assert steps["fair"] == steps["fcfs"], "the same plans whatever the policy"
    assert busy["fair"] <= busy["fcfs"] * 1.05  # sim device time


def test_interactive_overtakes_a_batch_backlog_and_batch_loses_nothing(tiny_model_dir):
    greedy = dict(temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_tokens=24, **greedy)
    batch = {0: [(f"b{i}", [5 + i, 6, 7], long, "", 10) for i in range(6)]}
    vip = [("vip", [9, 8, 7], SamplingParams(max_tokens=4, **greedy), "", -10)]
    config = make_config(tiny_model_dir, max_num_seqs=4, scheduling_policy="fair")

    idle = Harness(config)
    idle.run({0: vip})
    undisturbed = Harness(config)
    undisturbed.run(batch)
    busy = Harness(config)
    busy.run(merge(batch, {3: vip}))

    assert busy.scheduler.num_preemptions >= 1, "every seat was taken by batch work"
    print(f"priority: vip TTFT {ttft(busy, 'vip')} steps behind batch, {ttft(idle, 'vip')} idle")
    assert ttft(busy, "vip") <= 3 * ttft(idle, "vip")
    assert busy.outputs["vip"] == idle.outputs["vip"]
    for i in range(6):
        assert busy.outputs[f"b{i}"] == undisturbed.outputs[f"b{i}"], f"b{i} lost or changed"
        assert busy.finish[f"b{i}"] == "length"


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
def test_every_policy_finishes_everything(default_gguf, policy):
    h = engine(default_gguf, policy, max_num_seqs=4)
    h.run(merge(tenant_requests("A", 12, 20), tenant_requests("B", 3, 20, start=2)))
    assert set(h.finish.values()) == {"length"} and len(h.finish) == 15
    assert h.scheduler.blocks.num_free == h.scheduler.blocks.num_usable


def test_tenant_series_and_queue_state(default_gguf):
    registry = CollectorRegistry()
    config = sim_config(default_gguf, sim_profile="a100-llama-1.3b", max_num_seqs=4)
    h = Harness(config, metrics=CoreMetrics(registry))
    h.run(merge(tenant_requests("A", 12, 20), tenant_requests("B", 2, 20, start=1)))
    time.sleep(QUEUE_STATE_INTERVAL_S)
    h.core.step()  # the process loop steps while idle too: the last tokens reach the series
    value = registry.get_sample_value
    for tenant, n in (("A", 12), ("B", 2)):
        labels = {"tenant": tenant}
        # every request sends PROMPT: the ones admitted after the first step find its first
        # block cached, and cached prompt tokens are not charged
        cached = [d[-1].num_cached_tokens for rid, d in h.deltas.items() if rid[0] == tenant]
        assert len(cached) == n and sum(cached) > 0
        charged = 32 * n - sum(cached)
        assert value("gapless_tenant_service_tokens_total", {**labels, "kind": "prompt"}) == charged
        assert value("gapless_tenant_service_tokens_total", {**labels, "kind": "output"}) == 20 * n
        assert value("gapless_tenant_requests_waiting", labels) == 0, "nothing waits at the end"
    states = [m for m in h.frontend if isinstance(m, QueueState)]
    assert max(s.tenant_waiting[0].get("A", 0) for s in states) == 12 - 4
    assert states[-1].waiting == [0] and states[-1].drain_per_s > 0


def test_a_request_that_waits_too_long_is_ended(default_gguf):
    config = sim_config(
        default_gguf, sim_profile="a100-llama3-8b", max_num_seqs=1, max_queue_wait_s=0.05
    )
    h = Harness(config)
    h.run(
        {
            0: [
                ("long", PROMPT, SamplingParams(max_tokens=40)),
                ("late", PROMPT, SamplingParams(max_tokens=4)),
            ]
        }
    )
    assert h.finish == {"long": "length", "late": "queue_timeout"}
    (delta,) = h.deltas["late"]
    assert (delta.finish_reason, delta.code) == ("error", "queue_timeout")
    assert "--max-queue-wait" in delta.error and h.outputs["late"] == []


def test_a_copying_tenant_and_a_chatting_one_share_the_tokens_verified(default_gguf):
    """S9 (sim): equal weights; C's requests carry a `prediction` (each step verifies up to 4
    drafts, accepted at the profile's 0.7: about 2.8 tokens a step), H's chat (one a step).
    Tenants are charged for what the device verified, so while both wait each gets half of
    it: prompt tokens plus the fair policy's output weight per token verified, counted from
    the plans and results (bench/spec_tenants.py), not from the policy's counters."""
    config = sim_config(default_gguf, sim_profile="h100-llama3-8b", max_num_seqs=8,
                        num_speculative_tokens=4, sim_time_scale=0.01,
                        scheduling_policy="fair")  # fmt: skip
    got = run_spec_tenants(config, num_requests=60, prompt_len=16, max_tokens=32)
    print(f"copy vs chat: C's share {got.share('C'):.3f} of the service in "
          f"{got.window_steps} steps, requests done {got.done} (sim)")  # fmt: skip
    assert got.window_steps > 200, "a window long enough to measure"
    assert 0 < got.accepted < got.drafted, "C verified drafts and some were rejected"
    assert got.ratio >= 0.95, (got.prompt, got.verified)
    # C's requests each cost more (their rejected drafts), so fewer of them ran
    assert got.done["C"] < 0.85 * got.done["H"], got.done
