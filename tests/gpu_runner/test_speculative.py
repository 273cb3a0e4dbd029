"""Speculative decoding on the cpu device, in process: the tokens equal speculation off's,
greedy and at seeded temperature 0.8, with n-gram and suffix drafts and with a `prediction`, with steps
in flight (depth 2 and 3), with a KV cache small enough to preempt, and a stop inside a run."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from gapless.common.messages import SamplingParams
from gapless.common.step_costs import table_sizes
from gapless.core.metrics import CoreMetrics
from gapless.gpu_runner.backend import make_backend
from gapless.gpu_runner.cpu.calibrate import step_seconds
from gapless.gpu_runner.speculate import Drafts, ngram_lookup
from tests.engine_harness import Harness, make_config

# a prompt that repeats itself, so prompt lookup finds what comes next
BASE = [301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311, 312]
PROMPTS = [BASE * 3, [5, 6, 7, 8] * 6 + BASE, list(range(400, 440))]


def _params(i: int, temperature: float) -> SamplingParams:
    seed = None if temperature == 0 else 100 + i
    extra = {}
    if i == 1:  # penalties and min_tokens: each verify position sees the state so far
        extra = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "min_tokens": 8}
    return SamplingParams(max_tokens=24 + 5 * i, temperature=temperature, seed=seed, **extra)


def _run(model_dir, prediction: dict[str, list[int]] | None = None, metrics=None, **overrides):
    cfg = make_config(model_dir, max_num_seqs=4, max_num_batched_tokens=64, **overrides)
    h = Harness(cfg, metrics=metrics)
    for temp in (0.0, 0.8):
        for i, prompt in enumerate(PROMPTS):
            rid = f"{temp}-{i}"
            pred = (prediction or {}).get(rid)
            h.add(rid, prompt, _params(i, temp), prediction=pred)
    h.run()
    return h


@pytest.fixture(scope="module")
def off_run(tiny_model_dir):
    return _run(tiny_model_dir, speculative="off")


@pytest.fixture(scope="module")
def off(off_run):
    return off_run.outputs


@pytest.mark.parametrize("overlap,deep", [(True, 0.0), (True, 1e9)], ids=["two", "three"])
def test_ngram_output_equals_off(tiny_model_dir, off, overlap, deep):
    h = _run(tiny_model_dir, speculative="ngram", num_speculative_tokens=3, overlap=overlap,
             deep_plan_ms=deep)  # fmt: skip
    assert h.outputs == off
    assert (h.scheduler.rb.spec_extra == 0).all()


def test_suffix_output_equals_off(tiny_model_dir, off):
    h = _run(tiny_model_dir, speculative="suffix", num_speculative_tokens=3)
    assert h.outputs == off
    assert (h.scheduler.rb.spec_extra == 0).all()


def test_prediction_of_the_output_is_accepted_and_exact(tiny_model_dir, off, off_run):
    """The exact output as prediction: every draft accepted, so fewer steps; and a prediction
    with a wrong token in the middle re-aligns and still gives the same output."""
    wrong = {rid: ids[:6] + [7] + ids[7:] for rid, ids in off.items()}
    registry = CollectorRegistry()
    h = _run(tiny_model_dir, prediction=off, metrics=CoreMetrics(registry=registry),
             num_speculative_tokens=4)  # fmt: skip
    assert h.outputs == off
    drafted = registry.get_sample_value("gapless_spec_draft_tokens_total", {"method": "prediction"})
    accepted = registry.get_sample_value(
        "gapless_spec_accepted_tokens_total", {"method": "prediction"}
    )
    assert drafted and accepted and accepted >= 0.8 * drafted
    first = registry.get_sample_value("gapless_spec_position_accepted_total", {"position": "0"})
    assert first and first >= registry.get_sample_value(
        "gapless_spec_position_accepted_total", {"position": "3"}
    )
    assert h.steps < off_run.steps * 0.6
    assert _run(tiny_model_dir, prediction=wrong, num_speculative_tokens=4).outputs == off


def test_preemption_with_drafts_in_flight(tiny_model_dir, off):
    """A pool of 9 blocks for 6 requests: preemptions while verify steps are in flight."""
    cfg = make_config(tiny_model_dir, max_num_seqs=4, max_num_batched_tokens=64,
                      speculative="ngram", num_speculative_tokens=4)  # fmt: skip
    backend = make_backend(cfg)
    core_blocks = backend.num_blocks
    backend.executor.num_blocks = 10  # type: ignore[attr-defined]
    h = Harness(cfg, backend=backend)
    assert core_blocks >= 10
    for temp in (0.0, 0.8):
        for i, prompt in enumerate(PROMPTS):
            h.add(f"{temp}-{i}", prompt, _params(i, temp))
    h.run()
    assert h.outputs == off
    assert h.scheduler.num_preemptions > 0


def test_ngram_lookup_and_prediction_realign():
    assert ngram_lookup([1, 2, 3, 4, 9, 2, 3], 2) == [4, 9]
    assert ngram_lookup([1, 2, 3], 2) == []
    d = Drafts(2)
    d.add(0, "prediction", [10, 11, 12, 13, 14, 15], [])
    assert d.propose(0, 3) == [10, 11, 12]
    d.sampled(0, [10, 11, 99])  # a mismatch: lost until the output meets the prediction again
    assert d.propose(0, 2) == []
    d.sampled(0, [13])
    assert d.propose(0, 2) == [14, 15]


def test_a_stop_token_inside_an_accepted_run_ends_it_there(tiny_model_dir, off):
    """The output's 10th token as a stop id: speculation ends the run where off ends it."""
    ids = off["0.0-0"]
    stop = ids[9]
    params = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(stop,))
    outputs = []
    for spec in ({"speculative": "off"}, {"num_speculative_tokens": 4}):
        h = Harness(make_config(tiny_model_dir, **spec))
        h.add(
            "a", PROMPTS[0], params, prediction=ids if spec.get("num_speculative_tokens") else None
        )
        h.run()
        outputs.append((h.outputs["a"], h.finish["a"]))
    assert outputs[0] == outputs[1]
    assert outputs[0][0][-1] == stop and len(outputs[0][0]) == ids.index(stop) + 1


def test_calibration_times_each_size_and_leaves_no_trace(off_run):
    """The cpu's step-time table (speculation's cost model): a time per size, 3 tokens priced
    as the 4 they pad to (a verify of decodes runs padded up to the largest decode batch, 4
    here; past it eagerly, unpadded), and the KV blocks and inputs table it used are zero
    again."""
    ex = off_run.backend.executor
    assert ex.batch.max_padded == 4
    tokens, seconds = step_seconds(ex, table_sizes(40))
    assert tokens == [1, 2, 3, 4, 8, 16, 32, 40] and all(s > 0 for s in seconds)
    assert seconds[2] == seconds[3]
    bs = ex.batch.block_size
    used = (-(-40 // bs) + 1) * bs
    assert all(not cache[bs:used].any() for kv in ex.kv_cache for cache in kv)  # 0: scratch
    assert not ex.batch.table.any()
