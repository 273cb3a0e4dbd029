"""The sim device: its timing model, the emulated asynchronous device, and a whole engine loop."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from gapless.common.config import EngineConfig
from gapless.common.messages import NewSlot, SamplingParams, StepPlan
from gapless.common.model_files import load_tokenizer
from gapless.gpu_runner.sim import backend as sim_backend
from gapless.gpu_runner.sim.backend import SimBackend
from gapless.gpu_runner.sim.profiles import (
    GIB,
    PROFILES,
    SimProfile,
    get_profile,
    list_profiles,
    num_kv_blocks,
    profile_fields,
    step_cost,
    step_time,
)
from tests.conftest import sim_config
from tests.engine_harness import Harness

# ---------------------------------------------------------------- the timing model (sim)


def decode_time(name: str, batch: int, context: int) -> float:
    return step_time(get_profile(name), batch, batch, batch * context, 0)


def test_profiles_listed_and_unknown_names_rejected():
    names = list_profiles()
    for name in ("a100-llama-1.3b", "a100-llama3-8b", "h100-llama3-8b", "h100-llama3-70b-tp4"):
        assert name in names
    with pytest.raises(ValueError, match="h100-llama3-8b"):
        get_profile("h100-gpt5")


def test_step_time_is_monotone_in_tokens_and_context():
    for profile in PROFILES.values():
        by_batch = [step_time(profile, b, b, b * 1024) for b in (1, 8, 32, 128, 512)]
        assert by_batch == sorted(by_batch) and by_batch[0] < by_batch[-1]
        by_ctx = [step_time(profile, 32, 32, 32 * c) for c in (16, 256, 2048, 8192)]
        assert by_ctx == sorted(by_ctx) and by_ctx[0] < by_ctx[-1]
        by_prompt = [step_time(profile, t, 1, t, t) for t in (16, 128, 1024, 4096)]
        assert by_prompt == sorted(by_prompt) and by_prompt[0] < by_prompt[-1]


def test_measured_scales_model_the_real_runner_and_round_trip():
    published = get_profile("h100-llama3-8b")
    measured = SimProfile(**{**profile_fields(published), "decode_scale": 2.0,
                             "prefill_scale": 1.5})  # fmt: skip
    assert SimProfile(**profile_fields(measured)) == measured
    decode = (64, 64, 64 * 1024, 0)
    mixed = (1024 + 63, 64, 64 * 1024, 1024)
    assert step_time(measured, *decode) == pytest.approx(2.0 * step_time(published, *decode))
    assert step_time(measured, *mixed) == pytest.approx(1.5 * step_time(published, *mixed))
    assert step_cost(measured, *decode).memory_s == step_cost(published, *decode).memory_s
    assert all(p.decode_scale == p.prefill_scale == 1.0 for p in PROFILES.values())


def test_h100_decode_step_at_moderate_batch():
    # 64 seqs x 1.5k context: memory-bound. fp8 reads 8.0 GB weights + 6.4 GB KV per step:
    # ~5 ms (+-15%). bf16 reads twice that: ~10 ms (+-15%); see docs/sim-profiles.md.
    assert decode_time("h100-llama3-8b-fp8", 64, 1536) == pytest.approx(5.0e-3, rel=0.15)
    assert decode_time("h100-llama3-8b", 64, 1536) == pytest.approx(10.0e-3, rel=0.15)
    cost = step_cost(get_profile("h100-llama3-8b"), 64, 64, 64 * 1536)
    assert cost.memory_s > 3 * cost.compute_s


def test_the_short_step_profile():
    # Llama-3.2-1B ties its LM head to the embeddings: 1.24 B parameters, 2.47 GB in bf16;
    # a single decode reads them in about a millisecond on H100 (sim)
    p = get_profile("h100-llama3.2-1b")
    assert p.num_params == pytest.approx(1.236e9, rel=1e-3)
    assert decode_time("h100-llama3.2-1b", 1, 1024) == pytest.approx(1.0e-3, rel=0.1)
    assert decode_time("h100-llama3.2-1b", 128, 1152) < decode_time("h100-llama3-8b", 128, 1152) / 3


def test_time_scale_multiplies_the_device_time(config):
    plans = Planner(config.block_size), Planner(config.block_size)
    times = []
    for scale, p in zip((1.0, 0.25), plans, strict=True):
        sim = SimBackend(msgspec.structs.replace(config, sim_time_scale=scale))
        h = sim.launch(p.plan([(0, 20, 0, True)], [new_slot(0)]))
        times.append(sim.collect(h).timing.forward_s)
    # forward_s is a difference of perf_counter readings: after hours of uptime their last
    # bits are ~1e-11 s, so 1e-9 of a sub-millisecond step is below what they can tell
    assert times[1] == pytest.approx(0.25 * times[0], rel=1e-6)


def test_small_model_decodes_much_faster():
    small = decode_time("a100-llama-1.3b", 8, 1024)
    large = decode_time("a100-llama3-8b", 8, 1024)
    assert large > 3 * small


def test_prefill_of_1024_tokens_is_compute_bound():
    for profile in PROFILES.values():
        cost = step_cost(profile, 1024, 1, 1024, 1024)
        assert cost.compute_s > 2 * cost.memory_s, profile.name


def test_tensor_parallel_pays_all_reduces():
    tp = step_cost(get_profile("h100-llama3-70b-tp4"), 64, 64, 64 * 1024)
    single = step_cost(get_profile("h100-llama3-8b"), 64, 64, 64 * 1024)
    assert tp.comm_s > 0 and single.comm_s == 0


def test_kv_blocks_from_memory_and_capped_by_seats():
    p = get_profile("h100-llama3-8b")
    per_block = 2 * 32 * 8 * 128 * 2 * 16  # K,V x layers x kv heads x head dim x bf16 x 16
    fit = int((80 * GIB * 0.9 - p.weight_bytes) // per_block)
    assert num_kv_blocks(p, 16, 10_000, 8192) == fit
    assert num_kv_blocks(p, 16, 4, 8192) == 4 * 512 + 1


# ---------------------------------------------------------------- the backend


@pytest.fixture(scope="module")
def config(default_gguf) -> EngineConfig:
    return sim_config(default_gguf, sim_profile="h100-llama3-8b-fp8", seed=3)


class Planner:
    """Builds plans as the core would, handing out KV blocks from 1 upwards."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.seq = 0
        self.next_block = 1
        self.num_blocks: dict[int, int] = {}

    def plan(self, entries, new_slots=(), freed=()) -> StepPlan:
        """entries: (slot, num tokens, start position, carries ids); every entry samples."""
        self.seq += 1
        for slot in freed:
            del self.num_blocks[slot]
        num_new, new_blocks = [], []
        for slot, n, start, _ in entries:
            need = -(-(start + n) // self.block_size) - self.num_blocks.get(slot, 0)
            num_new.append(need)
            new_blocks.extend(range(self.next_block, self.next_block + need))
            self.next_block += need
            self.num_blocks[slot] = self.num_blocks.get(slot, 0) + need
        return StepPlan(
            seq=self.seq,
            new_slots=list(new_slots),
            freed_slots=list(freed),
            slots=[e[0] for e in entries],
            num_tokens=[e[1] for e in entries],
            start_pos=[e[2] for e in entries],
            has_tokens=[e[3] for e in entries],
            token_ids=[5] * sum(e[1] for e in entries if e[3]),
            sample=[True] * len(entries),
            num_new_blocks=num_new,
            new_blocks=new_blocks,
        )


def new_slot(slot: int, logprobs: int | None = None) -> NewSlot:
    params = SamplingParams(max_tokens=16, logprobs=logprobs)
    return NewSlot(slot=slot, params=params, num_prompt_tokens=20)


class FrozenClock:
    """The sim backend's clock, moved only by its own sleeps and by the test: what queues on the
    device then does not depend on how fast this machine plans."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_launches_queue_on_the_device_and_start_at_once_after_idle(config, monkeypatch):
    clock = FrozenClock()
    monkeypatch.setattr(sim_backend, "time", clock)
    sim = SimBackend(config)
    p = Planner(config.block_size)
    first = sim.launch(p.plan([(0, 20, 0, True), (1, 20, 0, True)], [new_slot(0), new_slot(1)]))
    second = sim.launch(p.plan([(0, 1, 20, False), (1, 1, 20, False)]))
    assert first.device_start >= first.launched
    assert second.device_start == first.device_end, "queued behind the first step"
    assert sim.seconds_until_ready(second) > 0
    r1, r2 = sim.collect(first), sim.collect(second)
    assert sim.seconds_until_ready(second) == 0
    assert r1.seq == 1 and r2.seq == 2 and len(r1.token_ids) == len(r2.token_ids) == 2
    assert r2.timing.published >= r2.timing.device_end >= r2.timing.device_start
    assert r2.timing.forward_s == pytest.approx(decode_time(config.sim_profile, 2, 21), rel=1e-6)
    clock.sleep(0.002)
    third = sim.launch(p.plan([(0, 1, 21, False)], freed=[1]))
    assert third.device_start == third.launched, "an idle device starts at launch"
    assert len(sim.collect(third).token_ids) == 1


def test_plans_must_come_in_order(config):
    sim = SimBackend(config)
    p = Planner(config.block_size)
    sim.launch(p.plan([(0, 4, 0, True)], [new_slot(0)]))
    p.seq -= 1  # the same plan again (a gap is allowed: a refused plan leaves one)
    with pytest.raises(AssertionError, match="out of order"):
        sim.launch(p.plan([(0, 1, 4, False)]))


def test_tokens_are_ordinary_and_never_eos(config):
    sim = SimBackend(config)
    tok = load_tokenizer(config.model)
    special = set(tok.get_added_tokens_decoder()) | set(config.model.eos_token_ids)
    p = Planner(config.block_size)
    slots = range(config.max_num_seqs)
    steps = [sim.launch(p.plan([(s, 8, 0, True) for s in slots], [new_slot(s) for s in slots]))]
    for pos in range(8, 40):
        steps.append(sim.launch(p.plan([(s, 1, pos, False) for s in slots])))
    ids = [t for h in steps for t in sim.collect(h).token_ids]
    assert len(ids) == 33 * config.max_num_seqs
    assert not special & set(ids)
    assert len(set(ids)) > len(ids) // 2, "spread over the vocabulary"
    assert all(tok.decode([t]).strip() for t in ids[:50])


def test_runs_are_reproducible(config):
    def run() -> list[int]:
        sim, p = SimBackend(config), Planner(config.block_size)
        h = sim.launch(p.plan([(0, 4, 0, True)], [new_slot(0)]))
        h2 = sim.launch(p.plan([(0, 1, 4, False)]))
        return sim.collect(h).token_ids + sim.collect(h2).token_ids

    first = run()
    assert len(first) == 2 and first == run()  # one token per step, the same both times


def test_logprobs_have_the_shapes_asked_for(config):
    sim = SimBackend(config)
    p = Planner(config.block_size)
    plan = p.plan(
        [(0, 4, 0, True), (1, 4, 0, True), (2, 4, 0, True)],
        [new_slot(0, logprobs=3), new_slot(1), new_slot(2, logprobs=0)],
    )
    r = sim.collect(sim.launch(plan))
    top3, none, only = r.logprobs
    assert none is None, "a row that asked nothing carries nothing"
    assert len(top3.top_ids) == len(top3.top_logprobs) == 3 and only.top_ids == []
    assert top3.top_ids[0] == r.token_ids[0] and top3.top_logprobs[0] == top3.logprob
    assert top3.top_logprobs == sorted(top3.top_logprobs, reverse=True)
    assert top3.logprob < 0 and only.logprob < 0
    plain = sim.collect(sim.launch(p.plan([(1, 1, 4, False)])))
    assert plain.logprobs == []


def test_kv_capacity_follows_the_profile(config):
    sim = SimBackend(config)
    profile = get_profile(config.sim_profile)
    expected = num_kv_blocks(profile, 16, config.max_num_seqs, config.model.max_model_len)
    assert sim.num_blocks == expected == config.max_num_seqs * 512 + 1
    with pytest.raises(ValueError, match="known:"):
        SimBackend(msgspec.structs.replace(config, sim_profile="nope"))


# ---------------------------------------------------------------- a whole engine loop


def test_engine_loop_finishes_requests_and_keeps_the_device_fed(config):
    cfg = msgspec.structs.replace(config, sim_profile="a100-llama3-8b")  # ~10 ms steps (sim)
    h = Harness(cfg)  # the real EngineCore, two plans ahead of the results
    params = SamplingParams(max_tokens=64)
    outputs = h.run({0: [(f"r{i}", list(range(100 + i, 140 + i)), params) for i in range(8)]})
    timings = [s for s in h.core.timeline.last(10_000) if s.num_seqs]
    assert h.finish == {rid: "length" for rid in outputs}
    assert all(len(ids) == 64 for ids in outputs.values())
    assert not set(cfg.model.eos_token_ids) & {t for ids in outputs.values() for t in ids}
    fed = 0
    for prev, cur in zip(timings[:-1], timings[1:], strict=True):
        assert cur.device_start >= prev.device_end, "steps run one at a time, in order"
        if cur.launched <= prev.device_end:  # queued while the device was busy: no gap
            assert cur.device_start == prev.device_end
            fed += 1
    # the loop launches step n+1 while step n runs (with depth 1 none would be queued);
    # a loaded 2-core host may launch a few late
    assert fed >= 0.8 * (len(timings) - 1), f"{fed} of {len(timings) - 1} steps queued"
    busy = np.sum([t.device_end - t.device_start for t in timings])
    span = timings[-1].device_end - timings[0].device_start
    assert busy > 0.8 * span
