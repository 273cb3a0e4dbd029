"""The `suffix` drafter: the index's matches and bounds, output equal to speculation off, a
tenant's repeated request drafted from its history, and another tenant's drafts unchanged by
that history (drafts are a side channel: a tenant never draws from another's requests)."""

from __future__ import annotations

import numpy as np

from gapless.common.messages import SamplingParams
from gapless.gpu_runner.backend import make_backend
from gapless.gpu_runner.suffix import SuffixIndex, longest_match
from tests.engine_harness import Harness, make_config

# distinct tokens, so a request finds nothing to copy in its own prompt
PLAIN = [int(t) for t in np.random.default_rng(7).permutation(np.arange(500, 900))[:40]]


def test_longest_match_prefers_length_then_the_latest():
    hist = np.asarray([1, 2, 3, 9, -1, 5, 2, 3, 7, -1, 2, 3, 8, -1], np.int64)
    end = len(hist) - 1
    assert longest_match(hist, np.asarray([1, 2, 3]), end, 1) == (3, 2)
    assert longest_match(hist, np.asarray([4, 2, 3]), end, 1) == (2, 11)
    assert longest_match(hist, np.asarray([5]), end, 1) == (1, 5)
    # a match that ends its request drafts nothing, so it is not a match
    assert longest_match(hist, np.asarray([7]), end, 1) == (0, -1)
    # of equal matches, the latest with k tokens after it; else the earliest
    assert longest_match(hist, np.asarray([4, 2, 3]), 13, 1) == (2, 11)
    assert longest_match(hist, np.asarray([4, 2, 3]), 13, 2) == (2, 7)
    assert longest_match(hist, np.asarray([4, 2, 3]), 13, 9) == (2, 2)


def test_a_run_of_one_token_drafts_k_of_it():
    assert SuffixIndex().propose("", [5, 9, 9, 9], 4) == [9]  # a 2-match beats a 1-match
    assert SuffixIndex().propose("", [9] * 8, 4) == [9] * 4


def test_a_tenant_drafts_from_its_own_history_only():
    index = SuffixIndex()
    index.add("a", [10, 11, 12, 13, 14, 15, 16])
    assert index.propose("a", [1, 11, 12], 3) == [13, 14, 15]
    assert index.propose("b", [1, 11, 12], 3) == []
    assert index.propose("", [1, 11, 12], 3) == []
    index.add("b", [11, 12, 40, 41])
    assert index.propose("b", [1, 11, 12], 3) == [40, 41]
    assert index.propose("a", [1, 11, 12], 3) == [13, 14, 15]
    # the request's own tokens win a tie and lose to a longer match in the history
    assert index.propose("a", [11, 12, 77, 5, 11, 12], 2) == [77, 5]
    assert index.propose("a", [11, 12, 77, 10, 11, 12], 2) == [13, 14]


def test_bounds_per_tenant_and_in_all_drop_the_least_recently_used():
    index = SuffixIndex(tenant_tokens=10, total_tokens=16)
    index.add("a", [1, 2, 3, 4])
    index.add("a", [5, 6, 7, 8])
    assert index.propose("a", [9, 1, 2], 1) == [3]  # the first request is now used last
    index.add("a", [20, 21, 22, 23])  # 12 > 10: the unused [5..8] goes
    assert index.tenants["a"].num_tokens == 8
    assert index.propose("a", [5, 6], 1) == [] and index.propose("a", [1, 2], 1) == [3]
    index.add("b", [30, 31, 32, 33, 34, 35])  # 14 in all
    index.add("b", [40, 41, 42])  # 17 > 16: a's least recently used request goes
    assert index.num_tokens == 13
    assert index.propose("a", [20, 21], 1) == [] and index.propose("a", [1, 2], 1) == [3]
    assert index.propose("b", [30, 31], 1) == [32]
    index.add("c", list(range(100, 130)))  # longer than a tenant may keep: its last 10
    assert index.tenants["c"].num_tokens == 10 and index.num_tokens <= 16
    assert index.propose("c", [120, 121], 1) == [122]
    assert "a" not in index.tenants  # every request of a went: so did a


def _serial(model_dir, requests: list[tuple[str, str]], max_tokens: int = 12):
    """Requests (id, tenant) of PLAIN one after another on one engine with suffix drafts;
    the outputs, the drafts proposed for each request, and the steps each request took."""
    # why depth 2 always and no step-time table: the drafts must not depend on timings
    cfg = make_config(model_dir, speculative="suffix", num_speculative_tokens=4, deep_plan_ms=0)
    backend = make_backend(cfg)
    backend.step_costs = ([], [])  # type: ignore[attr-defined]
    drafts = backend.executor.drafts  # type: ignore[attr-defined]
    proposed: dict[str, list[list[int]]] = {}
    propose = drafts.propose
    now: list[list[int]] = []

    def spy(slot: int, k: int) -> list[int]:
        now.append(propose(slot, k))
        return now[-1]

    drafts.propose = spy
    h = Harness(cfg, backend=backend)
    steps = {}
    for rid, tenant in requests:
        before, now = h.steps, []
        h.add(rid, PLAIN, SamplingParams(max_tokens=max_tokens, temperature=0.0), tenant=tenant)
        h.run()
        steps[rid], proposed[rid] = h.steps - before, now
    return h.outputs, proposed, steps


def test_a_tenant_repeating_a_request_drafts_from_it_and_no_other_tenant_does(tiny_model_dir):
    outputs, proposed, steps = _serial(tiny_model_dir, [("a1", "a"), ("a2", "a"), ("b1", "b")])
    assert outputs["a1"] == outputs["a2"] == outputs["b1"]
    # PLAIN has nothing to copy: a's first request drafts nothing at first; its second
    # drafts a1's output from the first step, as the suffix of PLAIN matches a1's tokens
    assert proposed["a1"][0] == []
    assert proposed["a2"][0] == outputs["a1"][:4]
    # b's drafts are exactly those of b alone on a fresh engine: a's history changed nothing
    _, alone, alone_steps = _serial(tiny_model_dir, [("b1", "b")])
    assert proposed["b1"][0] == []
    assert proposed["b1"] == alone["b1"]
    assert steps["b1"] == alone_steps["b1"]
