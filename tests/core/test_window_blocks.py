"""KV blocks that fall out of a sliding window go back to the pool while their request runs
(core/window.py): the scheduler with a fake runner that checks every key a query reads, and
the whole engine on a tiny random Mistral against transformers."""

from __future__ import annotations

import math
import time
from collections import deque

import pytest
import torch

from gapless.common.messages import AddRequest, SamplingParams, StepPlan, StepResult
from gapless.core.policy import make_policy
from gapless.core.scheduler import Scheduler
from tests.core.test_prefix_cache import check_blocks, checked
from tests.core.test_scheduler import make_scheduler
from tests.engine_harness import Harness, make_config
from tests.family_models import WINDOW, build

# ------------------------------------------------------------------ the scheduler, a fake runner

ROOT = 17


class KVRunner:
    """Runs plans in order over a fake KV pool. A position's KV is a chain value of its
    sequence's ids so far (what real KV depends on); each query reads the keys of its window
    through its slot's block table and asserts they hold its own sequence's values, from
    blocks its request still holds when the step is planned; the sampled id is a function of
    the last query's value, so a sequence's ids do not depend on how it was scheduled."""

    def __init__(self, s: Scheduler, window: int) -> None:
        self.s, self.window, self.bs = s, window, s.blocks.block_size
        self.kv: dict[int, int] = {}  # pool row -> value
        self.table: dict[int, list[int]] = {}  # slot -> its blocks, as the runner keeps them
        self.values: dict[int, list[int]] = {}  # slot -> value per position
        self.last: dict[int, int] = {}  # slot -> last sampled id
        self.reads = 0

    def row(self, slot: int, pos: int) -> int:
        return self.table[slot][pos // self.bs] * self.bs + pos % self.bs

    def run(self, plan: StepPlan) -> StepResult:
        for slot in plan.freed_slots:
            del self.table[slot], self.values[slot]
        for new in plan.new_slots:
            self.table[new.slot], self.values[new.slot] = [], []
        fed, nb, entries = 0, 0, []
        for j, slot in enumerate(plan.slots):
            self.table[slot] += plan.new_blocks[nb : nb + plan.num_new_blocks[j]]
            nb += plan.num_new_blocks[j]
            start, n = plan.start_pos[j], plan.num_tokens[j]
            if plan.has_tokens[j]:
                ids, fed = plan.token_ids[fed : fed + n], fed + n
            else:
                ids = [self.last[slot]]
            values = self.values[slot]
            if len(values) < start:  # a prefix hit: the values its cached blocks must hold
                req = self.s.rb.req[slot]
                for t in req.known_tokens(len(values), start):
                    values.append(hash((values[-1] if values else ROOT, t)))
            assert len(values) == start, "a slot computes its positions in order"
            for p, t in enumerate(ids, start):
                values.append(hash((values[-1] if values else ROOT, t)))
                self.kv[self.row(slot, p)] = values[p]
            entries.append((slot, start, n))
        tokens = []
        for j, (slot, start, n) in enumerate(entries):  # attention, after every write
            self._read(slot, start, n)
            if plan.sample[j]:
                tokens.append(self.values[slot][start + n - 1] % 50 + 3)  # never EOS
                self.last[slot] = tokens[-1]
        return StepResult(seq=plan.seq, token_ids=tokens)

    def _read(self, slot: int, start: int, n: int) -> None:
        req = self.s.rb.req[slot]
        held = set(req.blocks[int(self.s.rb.num_freed[slot]) :])
        values = self.values[slot]
        for q in range(start, start + n):
            for k in range(max(0, q - self.window + 1) if self.window else 0, q + 1):
                assert self.kv.get(self.row(slot, k)) == values[k], f"slot {slot} key {k}"
                assert self.table[slot][k // self.bs] in held, f"key {k} read from a freed block"
                self.reads += 1


def add(s: Scheduler, rid: str, prompt: list[int], max_tokens: int, priority: int = 0) -> None:
    s.add_request(
        AddRequest(
            request_id=rid,
            frontend_id=0,
            prompt_token_ids=prompt,
            params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            arrival_time=time.time(),
            priority=priority,
        )
    )


def drive(s: Scheduler, runner: KVRunner, depth: int, arrivals=None, each_step=None) -> dict:
    """Plans up to `depth` steps ahead, each run by the runner as it is planned, applies their
    results in order; arrivals[k]: (id, prompt, max_tokens[, priority]) added before step k.
    Returns each request's output ids."""
    arrivals, inflight, outputs = dict(arrivals or {}), deque(), {}
    for k in range(5000):
        for arrival in arrivals.pop(k, []):
            add(s, *arrival)
        while len(inflight) < depth and (step := s.schedule()) is not None:
            inflight.append((step, runner.run(step.plan)))
        if not inflight:
            if arrivals:
                continue
            assert not s.has_work, "the scheduler stalled"
            return outputs
        step, result = inflight.popleft()
        out = s.update_from_output(step, result)
        for req, t in zip(out.requests, out.token_ids, strict=True):
            outputs.setdefault(req.request_id, []).append(t)
        check_blocks(s)
        if each_step is not None:
            each_step(s)
    raise AssertionError("did not finish")


def held_in_decode(s: Scheduler) -> list[int]:
    """Blocks each running request holds, of those that have planned a decode step (a
    recompute after preemption prefills its outputs too)."""
    rb = s.rb
    return [
        len(r.blocks) - int(rb.num_freed[r.slot])
        for r in s.running
        if rb.computed[r.slot] > rb.prefill_end[r.slot]
    ]


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 40000, (length,), generator=gen).tolist() for _ in range(n)]


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("caching", [False, True], ids=["caching-off", "caching-on"])
def test_a_windowed_decode_holds_only_the_window_s_blocks(caching, depth):
    window, bs = 10, 4  # a window that is not a whole number of blocks
    bound = math.ceil(window / bs) + 1
    runs = {}
    for w in (window, 0):
        s = make_scheduler(num_blocks=64, block_size=bs, max_model_len=256,
                           prefix_caching=caching, window=w)  # fmt: skip
        runner, most = KVRunner(s, w), []

        def look(s, most=most, w=w):
            most.extend(held_in_decode(s))
            if w and not caching:  # with caching, blocks given back are free and reusable
                assert s.blocks.num_usable - s.blocks.num_free <= bound * len(s.running)

        arrivals = {2 * i: [(f"r{i}", p, 120)] for i, p in enumerate(prompts(3, 10))}
        runs[w] = drive(s, runner, depth, arrivals, look)
        assert runner.reads > 0 and s.blocks.num_free == s.blocks.num_usable
        if w:
            assert max(most) == bound, "a decoding request holds the window's blocks, no more"
        else:
            # without a window, all of them (the last is planned after the last look)
            assert max(most) >= s.blocks.blocks_for(10 + 120) - 1
    assert runs[window] == runs[0], "the same ids: every key read held what it should"


@pytest.mark.parametrize(
    "family, overrides, window",
    [
        ("mistral", {}, WINDOW),
        ("mistral", {"sliding_window": None}, 0),
        ("gemma3", {}, 0),  # global layers between the sliding ones: every block is kept
        ("llama", {}, 0),
    ],
)
def test_only_a_model_whose_every_layer_slides_has_a_kv_window(family, overrides, window):
    pytest.importorskip("transformers")
    from gapless.common.families import arch_from_config
    from tests.family_models import config_of

    raw = config_of(family, 1000, **overrides).to_dict()
    assert arch_from_config(raw, family).kv_window == window


def test_a_long_prompt_gives_back_blocks_between_its_chunks():
    s = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=16, max_model_len=256,
                       window=8)  # fmt: skip
    seen = []
    out = drive(s, KVRunner(s, 8), 2, {0: [("r0", prompts(1, 100)[0], 4)]},
                lambda s: seen.extend(len(r.blocks) - int(s.rb.num_freed[r.slot])
                                      for r in s.running))  # fmt: skip
    assert len(out["r0"]) == 4
    assert max(seen) <= math.ceil((8 - 1 + 16) / 4) + 1, "the window and one chunk, no more"


def test_freed_blocks_are_reused_with_preemption_and_prefix_hits():
    """A pool that holds one whole request (32 blocks): windowed requests run four at a time
    on it, a high-priority arrival preempts, repeated prompts hit the cache, including blocks
    given back by a request still running; the ids equal a run with every block kept and a
    large pool."""
    window, bs = 12, 4
    shared = prompts(1, 40, seed=3)[0]
    distinct = prompts(4, 30, seed=4)
    arrivals = {
        0: [("a", shared, 60), ("b", distinct[0], 60)],
        1: [("c", distinct[1], 60)],
        3: [("d", shared + distinct[2][:6], 60)],  # a's prompt, while a runs
        30: [("e", shared, 40)],  # again, blocks a gave back
        40: [("hi", distinct[3], 30, -10)],  # outranks everybody: a preemption
    }
    runs, reuse = {}, []
    for w, num_blocks, caching in [(window, 33, True), (window, 33, False), (0, 400, True)]:
        s = make_scheduler(num_blocks=num_blocks, block_size=bs, max_num_seqs=4,
                           max_model_len=128, max_num_batched_tokens=48, prefix_caching=caching,
                           window=w, policy=make_policy("priority"))  # fmt: skip
        given_back: set[int] = set()

        def note(s, given_back=given_back):
            held = {r: set(r.blocks[int(s.rb.num_freed[r.slot]) :]) for r in s.running}
            for r in s.running:
                mine = set(r.blocks[: int(s.rb.num_freed[r.slot])])
                given_back.update(mine)
                if any(mine & held[o] for o in s.running if o is not r):
                    reuse.append(r.request_id)

        runs[(w, caching)] = drive(s, KVRunner(s, w), 2, arrivals, note)
        assert s.num_preemptions > 0
        if caching:
            assert s.num_hit_tokens > 0
        assert bool(given_back) == bool(w)
    assert reuse, "blocks given back were held by other requests while their first owner ran"
    assert runs[(window, True)] == runs[(window, False)] == runs[(0, True)]


def test_a_head_evicted_while_its_request_runs_ends_its_registration():
    """Blocks given back named join the LRU, so a long request's first blocks are the first
    evicted once the empty ones run out: its head then names nothing, it registers nothing
    more, and a later request with its prompt finds only blocks that hold that prompt's KV
    (the runner checks every cached key it reads)."""
    window, bs = 8, 4
    p = prompts(3, 12, seed=5)
    s = make_scheduler(num_blocks=40, block_size=bs, max_model_len=128, window=window)
    seen = []

    def note(s):
        a = s.requests.get("a")
        if a is not None and a.slot >= 0 and s.rb.num_freed[a.slot]:
            seen.append(s.blocks.has_head(a.block_hashes[0]))

    arrivals = {0: [("a", p[0], 100)], 6: [("x", p[1], 30), ("y", p[2], 30)]}
    arrivals[70] = [("again", p[0], 10)]  # while a still runs
    drive(s, KVRunner(s, window), 2, arrivals, note)
    assert True in seen and False in seen, "a's head was named, then evicted while it ran"
    assert s.blocks.num_evictions > 0 and s.blocks.num_free == s.blocks.num_usable


# ------------------------------------------------------------------ the engine, a tiny Mistral

BS = 4
NEW_TOKENS = 64
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
PROMPT_LENS = [40, 33, 50, 28, 45]  # all longer than the window
assert min(PROMPT_LENS) > WINDOW


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, tiny_model_dir):
    """(model directory, prompts, transformers' greedy tokens) of a tiny random Mistral with
    a window over every layer."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("mistral-window")
    ref = build("mistral", out, tiny_model_dir)
    assert isinstance(ref, transformers.MistralForCausalLM)
    gen = torch.Generator().manual_seed(21)
    ps = [torch.randint(3, 40000, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    want = []
    for p in ps:
        with torch.no_grad():
            seq = ref.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                               eos_token_id=None, pad_token_id=0)  # fmt: skip
        want.append(seq[0, len(p) :].tolist())
    return out, ps, want


def _kv_bytes(model_dir, blocks: int) -> int:
    from gapless.common.model_files import load_arch, resolve_model

    arch = load_arch(resolve_model(str(model_dir)))
    return blocks * 2 * arch.num_layers * BS * arch.num_kv_heads * arch.head_dim * 4


POISON = 100.0  # what an empty block's KV is overwritten with: large enough to change any output


@pytest.mark.parametrize(
    "overlap, caching", [(True, True), (False, False)], ids=["overlap-caching", "no-overlap"]
)
def test_greedy_tokens_equal_transformers_while_freed_blocks_are_reused(mistral, overlap, caching):
    """A pool that holds one whole request runs four of them at once, each keeping only its
    window's blocks, with chunked prefill and a preemption (and with caching, a prefix-cache
    hit on blocks given back by a request still running). Every empty block's KV is
    overwritten before each step is planned (the cpu runs a step as it is launched, so the
    steps planned before have run) and, when one step was planned, before it runs, so a key
    read from a block given back too early changes the tokens; they equal transformers', and
    the allocator's invariants hold after every step."""
    model_dir, ps, want = mistral
    blocks = 1 + -(-(max(PROMPT_LENS) + NEW_TOKENS) // BS)  # block 0 and one whole request
    config = make_config(model_dir, overlap=overlap, block_size=BS, max_num_seqs=4,
                         max_num_batched_tokens=16, kv_cache_memory=_kv_bytes(model_dir, blocks),
                         scheduling_policy="priority", prefix_caching=caching)  # fmt: skip
    assert config.model.kv_window == WINDOW
    h = checked(Harness(config))
    s, kv = h.scheduler, h.backend.executor.kv_cache
    assert s.blocks.num_blocks == blocks
    bound, most, reused, poisoned = math.ceil(WINDOW / BS) + 2, [], [], []
    step = h.core.step

    def poison():
        rows = [r for b in s.blocks._empty for r in range(b * BS, (b + 1) * BS)]
        poisoned.append(len(rows))
        for k, v in kv:
            k[rows], v[rows] = POISON, -POISON

    def step_and_look(result=None):
        poison()  # every step planned so far has run
        out = step(result)
        if len(out.plans) == 1:  # a block given back while planning it is not read by it
            poison()
        most.extend(held_in_decode(s))
        held = {r: set(r.blocks[int(s.rb.num_freed[r.slot]) :]) for r in s.running}
        for r in s.running:
            given_back = set(r.blocks[: int(s.rb.num_freed[r.slot])])
            if any(given_back & held[o] for o in s.running if o is not r):
                reused.append(r.request_id)
        return out

    h.core.step = step_and_look
    arrivals = {0: [("r0", ps[0], GREEDY)], 3: [("r1", ps[1], GREEDY)], 4: [("r2", ps[2], GREEDY)]}
    # r0's prompt, when r0 has given back its first blocks named
    arrivals[2] = [("again", ps[0], GREEDY)]
    arrivals[20] = [("hi", ps[4], GREEDY, "", -10)]  # a fifth request that outranks the rest
    got = h.run(arrivals)
    for rid, i in [("r0", 0), ("r1", 1), ("r2", 2), ("again", 0), ("hi", 4)]:
        assert got[rid] == want[i], f"{rid}: prompt of {len(ps[i])} tokens"
    assert max(most) <= bound, "a decoding request holds only its window's blocks"
    assert reused, "blocks given back were held by another request while their first owner ran"
    assert (h.deltas["again"][-1].num_cached_tokens > 0) == caching, "r0's blocks were found"
    assert s.num_preemptions > 0 and sum(poisoned) > 0
    assert s.blocks.num_free == s.blocks.num_usable
