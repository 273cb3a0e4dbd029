"""Prefix caching: the block allocator alone, the scheduler with fake results, and the whole
engine (cpu runner, greedy outputs against transformers and against caching off; sim for
charging and reporting), with the allocator's invariants checked after every step."""

from __future__ import annotations

import time

import pytest
import torch

from gapless.common.messages import AddRequest, SamplingParams
from gapless.core.kv_blocks import BlockManager, chain_hashes, hash_root
from gapless.core.scheduler import Scheduler
from tests.conftest import sim_config
from tests.core.test_scheduler import fake_result, make_scheduler
from tests.engine_harness import Harness, make_config

# ------------------------------------------------------------------ the allocator


def test_hashes_chain_so_a_block_is_named_by_everything_before_it():
    root = hash_root("m", "")
    a = chain_hashes(root, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = chain_hashes(root, [9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1], "same block, other prefix: other name"
    assert chain_hashes(root, [1, 2, 3, 4, 5], 4) == a[:1], "a partial block has no name"
    assert chain_hashes(hash_root("m", "salt"), [1, 2, 3, 4], 4) != a[:1]
    assert chain_hashes(hash_root("other model", ""), [1, 2, 3, 4], 4) != a[:1]


def test_unreferenced_blocks_stay_cached_and_are_evicted_least_recently_used():
    m = BlockManager(num_blocks=5, block_size=4)  # 4 usable
    h = [bytes([i]) * 32 for i in range(4)]
    first, second = m.allocate(2), m.allocate(2)
    m.register(first, 0, 2, h[:2])
    m.register(second, 0, 2, h[2:])
    m.free(first, 2)
    m.free(second, 2)
    m.check()
    assert m.num_free == 4 and m.num_cached_free == 4
    assert m.lookup(h[:2]) == first and m.lookup([h[1]]) == [first[1]]
    m.take(m.lookup(h[2:3]))  # touched: held again, so not evictable
    assert m.num_free == 3
    got = m.allocate(2)  # the oldest unreferenced: first's tail, then its head
    assert got == [first[1], first[0]] and m.num_evictions == 2
    assert m.lookup(h[:2]) == [], "an evicted block's name is gone"
    m.check()
    m.free(got)  # not registered again
    assert m.num_free == 3 and m.num_cached_free == 1, "evicted blocks come back empty"


def test_references_are_counted_and_a_second_copy_stays_unnamed():
    m = BlockManager(num_blocks=4, block_size=4)
    h = [b"x" * 32]
    (a,) = m.allocate(1)
    m.register([a], 0, 1, h)
    m.take([a])  # a second request shares it
    m.free([a], 1)
    assert m.num_free == 2, "still held by one request"
    (b,) = m.allocate(1)  # the same content computed again elsewhere
    m.register([b], 0, 1, h)
    assert m.lookup(h) == [a]
    m.free([a], 1)
    m.free([b], 1)
    # the copy is reusable but never named (a lookup finds `a`); it waits in the LRU for its turn
    assert m.num_free == 3 and m.lookup(h) == [a] and m._hash[b] is None
    with pytest.raises(AssertionError, match="double free"):
        m.free([b], 1)
    m.check()


def test_names_wait_for_a_lookup_of_their_head_and_skip_blocks_evicted_meanwhile():
    m = BlockManager(num_blocks=6, block_size=2)  # 5 usable
    root = hash_root("m", "")
    tokens = [1, 2, 3, 4, 5, 6]
    h = chain_hashes(root, tokens, 2)
    blocks = m.allocate(3)
    m.register(blocks, 0, 1, h[:1])
    m.register(blocks, 1, 3, h[:1], tokens[2:])  # hashed only if asked
    assert m._hash[blocks[1]] is None and m._hash[blocks[2]] is None, "only the head is named"
    m.free(blocks, 3)
    m.check()
    m.allocate(2)  # the empty ones
    (evicted,) = m.allocate(1)  # then the oldest in the LRU: the tail
    assert evicted == blocks[2] and m.num_evictions == 1
    m.check()
    assert m.lookup(h) == blocks[:2], "the fragment names what was not handed out since"
    assert m._hash[evicted] is None
    m.check()


def test_evicting_a_head_drops_the_fragments_waiting_under_it():
    m = BlockManager(num_blocks=3, block_size=2)  # 2 usable
    h = chain_hashes(hash_root("m", ""), [1, 2, 3, 4], 2)
    blocks = m.allocate(2)
    m.register(blocks, 0, 2, h)
    m.free(blocks, 2)
    assert m.allocate(2) == [blocks[1], blocks[0]]
    assert not m._pending and not m._by_hash and m.lookup(h) == []
    m.check()


def test_lru_entries_left_stale_by_hits_are_compacted_in_order():
    m = BlockManager(num_blocks=4, block_size=2)  # 3 usable
    h = [bytes([i]) * 32 for i in range(3)]
    blocks = m.allocate(3)
    for b, x in zip(blocks, h, strict=True):
        m.register([b], 0, 1, [x])
    for b in reversed(blocks):  # LRU: blocks[2], blocks[1], blocks[0]
        m.free([b], 1)
    for _ in range(10):  # a hot block, taken and freed again and again
        m.take(m.lookup(h[2:]))
        m.free([blocks[2]], 1)
    assert len(m._lru) <= 2 * m.num_blocks, "stale entries are dropped, not kept forever"
    m.check()
    assert m.allocate(3) == [blocks[1], blocks[0], blocks[2]], "least recently used first"
    m.check()


def test_caching_off_names_nothing():
    m = BlockManager(num_blocks=4, block_size=4, caching=False)
    blocks = m.allocate(2)
    m.register(blocks, 0, 2, [b"a" * 32, b"b" * 32])
    m.free(blocks)
    assert m.num_cached == 0 and m.lookup([b"a" * 32]) == []


# ------------------------------------------------------------------ the scheduler


def add(s: Scheduler, rid: str, prompt: list[int], max_tokens=4, salt="", **params):
    return s.add_request(
        AddRequest(
            request_id=rid,
            frontend_id=0,
            prompt_token_ids=prompt,
            params=SamplingParams(max_tokens=max_tokens, **params),
            arrival_time=time.time(),
            cache_salt=salt,
        )
    )


def run_to_end(s: Scheduler, steps=200):
    for _ in range(steps):
        step = s.schedule()
        if step is None:
            return
        s.update_from_output(step, fake_result(step))
        s.blocks.check()
    raise AssertionError("did not finish")


SHARED = list(range(100, 120))  # 20 tokens: 5 full blocks of 4


def test_a_later_request_starts_at_its_first_uncached_token():
    s = make_scheduler(block_size=4)
    a = add(s, "a", SHARED + [1, 2, 3])
    run_to_end(s)
    b = add(s, "b", SHARED + [7, 8, 9, 10, 11])
    step = s.schedule()
    j = step.plan.slots.index(b.slot)
    assert step.plan.start_pos[j] == 20 and step.plan.num_tokens[j] == 5
    assert step.plan.token_ids == [7, 8, 9, 10, 11], "only the uncached tokens are fed"
    assert step.plan.num_new_blocks[j] == 7, "the cached blocks join its block table"
    assert step.plan.new_blocks[:5] == a.blocks[:5] or b.blocks[:5] == step.plan.new_blocks[:5]
    assert b.num_cached_prompt == 20 and step.num_cached_tokens == 20
    assert s.num_hit_tokens == 20 and s.num_queried_tokens == 23 + 25


def test_the_last_token_is_always_computed_into_a_block_of_its_own():
    s = make_scheduler(block_size=4)
    add(s, "a", SHARED)
    run_to_end(s)
    b = add(s, "b", SHARED)  # the whole prompt is cached, in 5 full blocks
    step = s.schedule()
    j = step.plan.slots.index(b.slot)
    assert step.plan.start_pos[j] == 16 and step.plan.num_tokens[j] == 4 and step.plan.sample[j]
    assert b.blocks[4] not in s.blocks.lookup(b.block_hashes[:5]), "a fresh last block"


def test_a_request_never_hits_blocks_its_own_step_fills():
    s = make_scheduler(block_size=4)
    add(s, "a", SHARED + [1])
    add(s, "b", SHARED + [2])  # same step: a's blocks are not written yet
    step = s.schedule()
    assert step.plan.start_pos == [0, 0] and step.num_cached_tokens == 0
    s.update_from_output(step, fake_result(step))
    add(s, "c", SHARED + [3])  # next step: they are (the runner runs plans in order)
    step = s.schedule()
    assert step.plan.start_pos[-1] == 20


def test_a_request_finds_the_chunks_a_running_request_has_had_planned():
    s = make_scheduler(block_size=4, max_num_batched_tokens=16)
    long = list(range(200, 240))  # 40 tokens
    a = add(s, "a", long + [1])
    for _ in range(2):
        step = s.schedule()  # a's chunks 0..15 and 16..31, sent in order
        s.update_from_output(step, fake_result(step))
    assert a.num_named == 0, "nobody asked yet: a's blocks wait unregistered"
    b = add(s, "b", long + [2])
    step = s.schedule()  # a's last 9 tokens and b's first chunk: b takes the 32 planned before
    j = step.plan.slots.index(b.slot)
    assert step.plan.start_pos[j] == 32, "blocks of steps planned earlier are found"
    assert b.blocks[:8] == a.blocks[:8] and a.num_named == 8
    s.blocks.check()
    run_to_end(s)
    c = add(s, "c", long + [3])
    s.schedule()
    assert c.num_cached_prompt == 40, "a leaving registered the rest of its blocks"


def test_a_salt_keeps_requests_apart():
    s = make_scheduler(block_size=4)
    add(s, "a", SHARED + [1], salt="tenant-a")
    run_to_end(s)
    b = add(s, "b", SHARED + [1], salt="tenant-b")
    c = add(s, "c", SHARED + [1])
    d = add(s, "d", SHARED + [1], salt="tenant-a")
    s.schedule()
    assert (b.num_cached_prompt, c.num_cached_prompt, d.num_cached_prompt) == (0, 0, 20)


def test_caching_off_computes_everything():
    s = make_scheduler(block_size=4, prefix_caching=False)
    add(s, "a", SHARED + [1])
    run_to_end(s)
    b = add(s, "b", SHARED + [1])
    step = s.schedule()
    assert step.plan.start_pos == [0] and b.num_cached_prompt == 0 and s.num_hit_tokens == 0


def test_finished_outputs_are_cacheable():
    """A follow-up turn that resends prompt + answer hits the answer's blocks too."""
    s = make_scheduler(block_size=4)
    a = add(s, "a", SHARED, max_tokens=9)
    outputs = []
    for _ in range(30):
        step = s.schedule()
        if step is None:
            break
        s.update_from_output(step, fake_result(step, token=len(outputs) % 5 + 30))
        outputs = a.output_ids
    assert len(outputs) == 9
    # 20 + 9 = 29 tokens, 28 of them fed (the last sample is never fed): 7 full blocks
    b = add(s, "b", SHARED + outputs + [5, 6])
    s.schedule()
    assert b.num_cached_prompt == 28


def test_penalties_get_the_cached_ids():
    s = make_scheduler(block_size=4)
    add(s, "a", SHARED + [1])
    run_to_end(s)
    add(s, "b", SHARED + [2], repetition_penalty=1.2)
    add(s, "c", SHARED + [3])
    step = s.schedule()
    b, c = step.plan.new_slots
    assert b.cached_ids == SHARED and c.cached_ids == []


def test_fair_share_charges_only_computed_prompt_tokens():
    s = make_scheduler(block_size=4)
    add(s, "a", SHARED + [1])
    run_to_end(s)
    s.policy.charge_prompt = lambda req, n: charged.append((req.request_id, n))
    charged: list = []
    add(s, "b", SHARED + [1, 2, 3])
    run_to_end(s)
    assert charged == [("b", 3)]


# ------------------------------------------------------------------ the engine


def check_blocks(s) -> None:
    """The allocator's invariants: blocks in one place, and every running request's
    references counted (but those it gave back, out of a sliding window)."""
    s.blocks.check()
    held: dict[int, int] = {}
    for req in s.running:
        for b in req.blocks[int(s.rb.num_freed[req.slot]) :]:
            held[b] = held.get(b, 0) + 1
    assert held == {b: n for b, n in enumerate(s.blocks._ref) if n}, "references"


def checked(h: Harness) -> Harness:
    """Assert the allocator's invariants after every step."""
    step = h.core.step

    def step_and_check(result=None):
        out = step(result)
        check_blocks(h.scheduler)
        return out

    h.core.step = step_and_check
    return h


GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def shared_prefix_reference(tiny_model_dir):
    """Prompts that share prefixes (a system prompt, a longer shared history, repeats), with
    transformers' greedy continuation of each."""
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(11)

    def rand(n):
        return torch.randint(3, 40000, (n,), generator=gen).tolist()

    system, history = rand(37), rand(20)
    prompts = [
        system + rand(5),
        system + rand(12),
        system + history + rand(3),
        system + history + rand(9),
        system + rand(5)[:0] + history,  # a prefix of the two before
        rand(30),
        system + history + rand(3)[:0],  # a repeat
    ]
    want = []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([p]), max_new_tokens=10, do_sample=False, pad_token_id=0
            )
        want.append(out[0, len(p) :].tolist())
    return prompts, want


@pytest.mark.parametrize(
    "depth, deep_plan_ms", [(1, 0.0), (2, 0.0), (3, 1e9)], ids=["no-overlap", "overlap", "deep"]
)
@pytest.mark.parametrize(
    "limits",
    [
        dict(max_num_batched_tokens=32),  # chunked prefill
        dict(max_num_batched_tokens=32, kv_cache_memory=11 * 4096, block_size=4),  # preemption
    ],
    ids=["chunked", "preempting"],
)
def test_greedy_outputs_equal_transformers_with_caching_on_and_off(
    tiny_model_dir, shared_prefix_reference, depth, deep_plan_ms, limits
):
    prompts, want = shared_prefix_reference
    hits = {}
    for caching in (False, True):
        config = make_config(
            tiny_model_dir,
            overlap=depth > 1,
            deep_plan_ms=deep_plan_ms,
            prefix_caching=caching,
            **limits,
        )
        h = checked(Harness(config))
        arrivals: dict = {}
        for i, p in enumerate(prompts):  # staggered: later ones find the earlier ones' blocks
            arrivals.setdefault(2 * i, []).append((f"r{i}", p, GREEDY))
        got = h.run(arrivals)
        for i in range(len(prompts)):
            assert got[f"r{i}"] == want[i], f"caching {caching}: request {i}"
        s = h.scheduler
        if "kv_cache_memory" in limits:
            assert s.num_preemptions > 0, f"caching {caching}: the small cache was meant to preempt"
        assert s.blocks.num_free == s.blocks.num_usable
        assert h.max_inflight == depth
        hits[caching] = s.num_hit_tokens
        cached = [h.deltas[f"r{i}"][-1].num_cached_tokens for i in range(len(prompts))]
        assert (sum(cached) > 0) == caching, cached
    assert hits[False] == 0 and hits[True] > 0


def test_eviction_under_pressure_keeps_outputs_and_counts(tiny_model_dir):
    """A cache that holds a few prompts serves many distinct and repeated ones."""
    gen = torch.Generator().manual_seed(5)
    distinct = [torch.randint(3, 40000, (24,), generator=gen).tolist() for _ in range(6)]
    order = [0, 1, 0, 2, 3, 0, 4, 1, 5, 2, 0, 3]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = {}
    for caching in (False, True):
        limits = dict(kv_cache_memory=10 * 4096, block_size=4, max_num_batched_tokens=32)
        h = checked(Harness(make_config(tiny_model_dir, prefix_caching=caching, **limits)))
        arrivals = {4 * k: [(f"q{k}", distinct[i], params)] for k, i in enumerate(order)}
        outs[caching] = h.run(arrivals)
        blocks = h.scheduler.blocks
        assert blocks.num_usable == 19, "the cache holds two prompts and their outputs (8 blocks)"
        if caching:
            assert blocks.num_evictions > 0 and h.scheduler.num_hit_tokens > 0
            repeats = [f"q{k}" for k, i in enumerate(order) if i in order[:k]]
            assert any(h.deltas[r][-1].num_cached_tokens for r in repeats)
        else:
            assert blocks.num_evictions == 0
    assert outs[True] == outs[False]
    for k, i in enumerate(order):  # the same prompt gives the same output every time
        assert outs[True][f"q{k}"] == outs[True][f"q{order.index(i)}"]


def test_sim_charges_prefill_only_for_computed_tokens(default_gguf):
    """With a shared prefix the sim device is busy for less time: cached tokens are free."""
    prefix = list(range(2000, 3024))  # 1,024 tokens
    busy, prefill = {}, {}
    for caching in (False, True):
        h = Harness(sim_config(default_gguf, prefix_caching=caching, max_num_batched_tokens=2048))
        arrivals = {
            4 * i: [(f"r{i}", prefix + [5000 + i] * 8, SamplingParams(max_tokens=4))]
            for i in range(4)
        }
        h.run(arrivals)
        steps = h.core.timeline.last(100)
        prefill[caching] = sum(s.num_prefill_tokens for s in steps)
        # device time of the steps that computed prompt tokens (they decode too, sim)
        busy[caching] = sum(s.device_end - s.device_start for s in steps if s.num_prefill_tokens)
    assert prefill[False] == 4 * 1032
    assert prefill[True] == 1032 + 3 * (1032 - 1024), "three requests compute their 8 own tokens"
    assert busy[True] < 0.5 * busy[False], busy


def test_metrics_stats_and_timeline_report_the_cache(default_gguf):
    from prometheus_client import CollectorRegistry

    from gapless.core.metrics import CoreMetrics

    registry = CollectorRegistry()
    h = Harness(sim_config(default_gguf), metrics=CoreMetrics(registry))
    prefix = list(range(2000, 2064))  # 64 tokens, 4 blocks
    arrivals = {4 * i: [(f"r{i}", prefix + [3000 + i] * 4, SamplingParams(max_tokens=3))]
                for i in range(3)}  # fmt: skip
    h.run(arrivals)
    value = registry.get_sample_value
    assert value("gapless_prefix_cache_queried_tokens_total") == 3 * 68
    assert value("gapless_prefix_cache_hit_tokens_total") == 2 * 64
    assert value("gapless_prefix_cache_hit_rate") == pytest.approx(128 / 204)
    assert [h.deltas[f"r{i}"][-1].num_cached_tokens for i in range(3)] == [0, 64, 64]
    steps = h.core.timeline.last(100)
    assert sum(s.num_cached_tokens for s in steps) == 128
    stats = h.core.stats(token=1)
    # each request's 4 prefix blocks are shared; its own tail and outputs fill a block more
    assert stats.num_cached_blocks >= 4 and stats.num_cached_free_blocks == stats.num_cached_blocks
    assert (stats.prefix_queried_tokens, stats.prefix_hit_tokens) == (204, 128)
    assert stats.num_free_blocks == stats.num_total_blocks


def test_with_no_shared_prefix_caching_plans_the_same_steps(default_gguf):
    """0% hits: caching on and off compute the same tokens in the same steps (host time on and
    off is compared in bench/RESULTS.md)."""
    plans = {}
    for caching in (False, True):
        rng = torch.Generator().manual_seed(3)  # the same prompts each time
        h = Harness(sim_config(default_gguf, prefix_caching=caching, max_num_batched_tokens=256))
        sent = []
        step = h.core.step

        def record(result=None, step=step, sent=sent):
            out = step(result)
            sent += [(p.slots, p.num_tokens, p.start_pos, p.new_blocks) for p in out.plans]
            return out

        h.core.step = record
        arrivals = {
            2 * i: [(f"r{i}", torch.randint(3, 40000, (100,), generator=rng).tolist(),
                     SamplingParams(max_tokens=20))]
            for i in range(12)
        }  # fmt: skip
        h.run(arrivals)
        assert h.scheduler.num_hit_tokens == 0
        plans[caching] = sent
    assert plans[True] == plans[False]


def test_the_frontends_hashes_are_the_ones_the_core_computes():
    s = make_scheduler(block_size=4, model_salt="model-path")
    prompt = SHARED + [1, 2]
    computed = add(s, "a", prompt, salt="t")
    assert s.prefix.hashes(computed, 5)[:5] == chain_hashes(hash_root("model-path", "t"), prompt, 4)
    run_to_end(s)
    given = s.add_request(
        AddRequest(
            request_id="b",
            frontend_id=0,
            prompt_token_ids=prompt,
            params=SamplingParams(max_tokens=2),
            arrival_time=time.time(),
            cache_salt="t",
            block_hashes=chain_hashes(hash_root("model-path", "t"), prompt, 4),
        )
    )
    s.schedule()
    assert given.num_cached_prompt == 20


def test_the_overhead_bench_compares_the_same_tokens(default_gguf, capsys):
    from gapless.bench.core_overhead import main

    main(["--requests", "12", "--prompt-len", "96", "--max-tokens", "4", "--runs", "1",
          "--sim-time-scale", "0.01", "--kv-blocks", "64"])  # fmt: skip
    out = capsys.readouterr().out
    off, on = (line for line in out.splitlines() if line.startswith("caching"))
    assert "hit tokens 0," in off and "hit tokens 0," in on, out
    assert "evictions 0," in off and "evictions 0," not in on, "64 blocks: caching on evicts"
    same = off.split(", evictions")[0].split(": ", 1)[1]  # steps, prefill and hit tokens
    assert same == on.split(", evictions")[0].split(": ", 1)[1], out
    assert "on / off, host time over a run: median" in out


def test_the_counted_scheduler_run_plans_the_same_steps_on_and_off(capsys):
    """What `core_overhead --instructions` counts under valgrind, run here without it."""
    from gapless.bench.core_overhead import main

    small = ["--requests", "12", "--prompt-len", "96", "--max-tokens", "4", "--kv-blocks", "64"]
    main([*small, "--count-one", "off"])
    main([*small, "--count-one", "on"])
    off, on = capsys.readouterr().out.splitlines()
    assert off.startswith("steps ") and "hit tokens 0," in on, (off, on)
    assert off.split(", evictions")[0] == on.split(", evictions")[0], "the same steps"
    assert "evictions 0," in off and "evictions 0," not in on, "64 blocks: caching on evicts"
