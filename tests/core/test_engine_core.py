"""The real EngineCore in-process with the sim device and a real detokenizer state, no ZMQ:
whole lives of requests that end by length, a stop string, an abort and an error, with a KV
cache small enough to force preemption."""

from __future__ import annotations

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from gapless.common.config import EngineConfig
from gapless.common.messages import SamplingParams
from gapless.common.model_files import load_tokenizer
from gapless.core.metrics import CoreMetrics
from gapless.gpu_runner.sim.backend import SimBackend
from tests.conftest import sim_config
from tests.engine_harness import Harness

PROMPT = list(range(1000, 1040))  # 40 tokens: with 40 outputs, 5 blocks of 16


@pytest.fixture(scope="module")
def config(default_gguf) -> EngineConfig:
    return sim_config(default_gguf, max_num_seqs=4, max_num_batched_tokens=64, seed=5)


def small_cache_engine(config: EngineConfig, usable_blocks: int, metrics=None) -> Harness:
    sim = SimBackend(config)
    sim.num_blocks = usable_blocks + 1  # block 0 is reserved
    return Harness(config, backend=sim, metrics=metrics)


# (overlap, deep_plan_ms) -> the steps in flight: 3 when every step is "short"
DEPTHS = {1: (False, 0.0), 2: (True, 0.0), 3: (True, 1e9)}


@pytest.mark.parametrize("depth", [3, 2, 1], ids=["deep", "overlap", "no-overlap"])
def test_whole_lives_under_preemption(config, depth):
    registry = CollectorRegistry()
    overlap, deep_plan_ms = DEPTHS[depth]
    cfg = msgspec.structs.replace(config, overlap=overlap, deep_plan_ms=deep_plan_ms)
    h = small_cache_engine(cfg, usable_blocks=12, metrics=CoreMetrics(registry))
    long = SamplingParams(max_tokens=40)
    arrivals = {
        0: [("a", PROMPT, long), ("b", PROMPT, long), ("gone", PROMPT, long)],
        1: [("c", PROMPT, long), ("e-stop", PROMPT, SamplingParams(max_tokens=40, stop=("e",)))],
        2: [("too-long", list(range(9000)), long)],
    }
    h.run(arrivals, aborts={4: ["gone"]})

    s = h.scheduler
    assert s.num_preemptions > 0, "12 blocks hold two of these requests, not four"
    assert h.max_inflight == depth
    assert h.finish == {
        "a": "length",
        "b": "length",
        "c": "length",
        "gone": "abort",
        "e-stop": "stop_string",
        "too-long": "error",
    }
    tokenizer = load_tokenizer(config.model)
    for rid in ("a", "b", "c"):
        deltas = h.deltas[rid]
        assert len(h.outputs[rid]) == 40, rid
        assert [d.finish_reason for d in deltas].count("length") == 1
        assert deltas[-1].finish_reason == "length" and deltas[-1].num_output_tokens == 40
        assert "".join(d.text for d in deltas) == tokenizer.decode(h.outputs[rid])
    assert all(d.finish_reason is None for d in h.deltas["gone"]), "an abort sends nothing"
    stop = h.deltas["e-stop"]
    assert stop[-1].finish_reason == "stop" and "e" not in "".join(d.text for d in stop)
    (err,) = h.deltas["too-long"]
    assert err.finish_reason == "error" and "context" in err.error and h.outputs["too-long"] == []
    # nothing held anywhere once every request ended
    assert s.requests == {} and not s.has_work and not h.core.inflight
    assert s.blocks.num_free == s.blocks.num_usable
    assert h.detok.num_requests == 0
    # each end counted once, by the reason a client sees
    finished = {
        reason: registry.get_sample_value(
            "gapless_requests_finished_total", {"finish_reason": reason}
        )
        for reason in ("length", "stop", "abort", "error")
    }
    assert finished == {"length": 3, "stop": 1, "abort": 1, "error": 1}


def test_abort_of_a_waiting_request_and_an_unknown_id(config):
    h = small_cache_engine(config, usable_blocks=6)  # room for one request at a time
    p = SamplingParams(max_tokens=40)
    h.run({0: [("first", PROMPT, p), ("queued", PROMPT, p)]}, aborts={1: ["queued", "nobody"]})
    assert h.finish == {"first": "length", "queued": "abort"}
    assert h.outputs["queued"] == [] and h.deltas["queued"] == []
    assert h.scheduler.requests == {} and h.detok.num_requests == 0


@pytest.mark.parametrize("scale, depth", [(1.0, 3), (10.0, 2)], ids=["short-steps", "long-steps"])
def test_plans_three_ahead_only_while_the_device_steps_are_short(config, scale, depth):
    """h100-llama3.2-1b decodes one request in ~1 ms a step, under the default deep_plan_ms
    of 4; ten times slower, over it."""
    cfg = msgspec.structs.replace(config, sim_profile="h100-llama3.2-1b", sim_time_scale=scale)
    assert cfg.deep_plan_ms == 4.0, "the default"
    h = Harness(cfg, backend=SimBackend(cfg))
    assert h.core.depth == 2, "no step seen yet: two ahead"
    h.run({0: [("a", PROMPT, SamplingParams(max_tokens=30))]})
    assert h.max_inflight == depth
    assert h.core.depth == depth
    assert len(h.outputs["a"]) == 30 and h.finish["a"] == "length"
