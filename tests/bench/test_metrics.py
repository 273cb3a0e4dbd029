from __future__ import annotations

import math

import numpy as np
import pytest

from gapless.bench.loadgen import arrival_offsets
from gapless.bench.metrics import distribution, samples, summarize
from gapless.bench.report import format_ratios, format_run, ratios
from gapless.bench.timeline import idle_fraction, run_steps, step_breakdown, timeline_summary
from tests.bench.records import record, run_doc, step


def test_distribution():
    d = distribution([0.001 * x for x in range(1, 101)])  # 1..100 ms
    assert d["mean"] == pytest.approx(50.5)
    assert d["p50"] == pytest.approx(50.5)
    assert d["p90"] == pytest.approx(90.1)
    assert d["p99"] == pytest.approx(99.01)
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_summarize():
    records = [
        record(0.1, [0.02, 0.02, 0.02], 4),
        record(0.3, [0.04, 0.04, 0.04], 4),
        record(0, [], 0, ok=False),
    ]
    s = summarize(records, duration_s=2.0)
    assert (s["num_requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["errors"] == {"HTTP 500: boom": 1}
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_token_throughput"] == pytest.approx(4.0)
    assert s["total_input_tokens"] == 20
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["itl_ms"]["mean"] == pytest.approx(30.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(30.0)  # (e2e - ttft) / (tokens - 1)
    assert s["e2e_ms"]["p50"] == pytest.approx(((0.16 + 0.42) / 2) * 1000)
    assert samples(records)["itl_ms"] == [20.0] * 3 + [40.0] * 3


def test_tpot_needs_two_tokens():
    assert record(0.1, [], 1).tpot is None
    assert summarize([record(0.1, [], 1)], 1.0)["tpot_ms"]["mean"] is None


def test_poisson_arrivals():
    assert np.all(arrival_offsets(5, math.inf, 0) == 0)
    a = arrival_offsets(2000, 50.0, 1)
    assert a[0] == 0 and np.all(np.diff(a) >= 0)
    assert np.diff(a).mean() == pytest.approx(1 / 50, rel=0.1)
    assert np.array_equal(a, arrival_offsets(2000, 50.0, 1))


def test_timeline_reduction_uses_only_the_runs_steps():
    before = {"device": "cpu", "overlap": True, "steps": [step(4, 1.0, 10, 0)]}
    after = {
        "device": "cpu",
        "overlap": True,
        "steps": [step(i, 1.0 + 0.02 * i, 10, 5 if i > 5 else 0) for i in range(3, 9)]
        + [step(9, 2.0, 10, 99, num_tokens=0)],  # an empty step counts neither way
    }
    steps = run_steps(after, 4)
    assert [s["seq"] for s in steps] == [5, 6, 7, 8, 9]
    fraction, busy, idle = idle_fraction(steps)
    assert busy == pytest.approx(0.040) and idle == pytest.approx(0.015)
    assert fraction == pytest.approx(15 / 55)
    out = timeline_summary(before, after)
    assert out["device"] == "cpu" and out["overlap"] is True
    assert out["device_idle_fraction"] == pytest.approx(15 / 55)
    b = out["step_breakdown_ms"]
    assert b["schedule"] == pytest.approx(8.0) and b["forward"] == pytest.approx(10.0)
    assert b["sample"] == pytest.approx(0.1) and b["apply_result"] == pytest.approx(0.3)
    assert out["timeline"]["num_steps"] == 5 and out["timeline"]["complete"]


def test_steady_step_is_the_full_batch_decode_median():
    """Admission (prefill) and drain (a smaller batch) steps are shorter; TPOT is set by the
    full batch's decode steps, whose median forward the summary reports apart."""
    steps = (
        [step(i, 0.01 * i, 0.9, 0, num_prefill_tokens=64) for i in range(4)]  # admission
        + [step(i, 0.01 * i, 2.0 + 0.1 * (i % 3), 0, num_seqs=128) for i in range(4, 9)]
        + [step(i, 0.01 * i, 1.2, 0, num_seqs=40) for i in range(9, 16)]  # drain
    )
    out = timeline_summary(None, {"device": "sim:x", "overlap": True, "steps": steps})
    assert out["steady_decode_step_ms"] == pytest.approx(2.1)
    assert out["step_breakdown_ms"]["forward"] == pytest.approx(1.2), "every step's median"
    assert timeline_summary(None, None)["steady_decode_step_ms"] is None


def test_no_timeline_gives_nulls():
    out = timeline_summary(None, None)
    assert out["device"] is None and out["device_idle_fraction"] is None
    assert out["overlap"] is None and out["timeline"] is None
    stages = {"schedule", "prepare_inputs", "forward", "sample", "apply_result"}
    assert set(out["step_breakdown_ms"]) == stages
    assert all(v is None for v in out["step_breakdown_ms"].values())
    assert step_breakdown([]) == dict.fromkeys(out["step_breakdown_ms"])


def test_ratios_and_tables():
    runs = [run_doc("a", 10.0, 0.1), run_doc("b", 5.0, 0.3)]
    table = ratios(runs)
    assert len(table) == 1 and table[0]["target"] == "b" and table[0]["baseline"] == "a"
    assert table[0]["request throughput"] == pytest.approx(0.5)
    assert table[0]["TTFT p50"] == pytest.approx(3.0)
    text = format_ratios(table)
    assert "b / a on 8:2" in text and "0.500x" in text
    run = format_run(runs[0])
    assert "no engine timeline" in run and "TTFT" in run


def test_saved_run_with_dropped_stages():
    # runs saved before the timeline lost its detokenize and stream fields hold those keys
    run = run_doc("a", 10.0, 0.1)
    run["step_breakdown_ms"] = {"schedule": 1.5, "forward": 8.0, "detokenize": None, "stream": None}
    text = format_run(run)
    assert "1.500" in text and "8.000" in text
    assert "detokenize" not in text and "stream" not in text


def test_replicas_add_up_and_each_is_reported():
    """--data-parallel-size 2: the idle fraction is over both replicas' steps, each replica has
    its own, and each rank's device time and the routing come from /metrics' counters."""
    from gapless.bench.run import counter_deltas
    from gapless.bench.timeline import num_replicas, replicas_summary

    def timeline(steps):
        return {"device": "sim:x", "overlap": True, "num_replicas": 2, "steps": steps}

    before = [timeline([step(1, 1.0, 10, 0)]), timeline([])]
    after = [
        timeline([step(i, 1.0 + 0.02 * i, 10, 10) for i in range(1, 4)]),  # 2 of the run's
        timeline([step(i, 1.0 + 0.02 * i, 10, 0, num_cached_tokens=4) for i in range(1, 5)]),
    ]
    assert num_replicas(after[0]) == 2 and num_replicas(None) == 1
    out = replicas_summary(before, after)
    assert out["device_idle_fraction"] == pytest.approx(20 / 80)
    assert out["timeline"]["num_steps"] == 6 and out["timeline"]["num_cached_tokens"] == 16
    one, two = out["replicas"]
    assert one["device_idle_fraction"] == pytest.approx(0.5) and one["num_steps"] == 2
    assert two["device_idle_fraction"] == 0.0 and two["num_tokens"] == 32
    assert replicas_summary(before[:1], after[:1]).get("replicas") is None

    ranks, routed = "gapless_rank_device_busy_seconds_total", "gapless_routed_requests_total"
    grown = counter_deltas(
        {(ranks, "0/0"): 1.0, (routed, "0/load"): 2},
        {(ranks, "0/0"): 3.5, (ranks, "1/0"): 2.0, (routed, "0/load"): 5, (routed, "1/prefix"): 1},
    )
    assert grown["rank_device_busy_s"] == {"0/0": 2.5, "1/0": 2.0}
    assert grown["routed_requests"] == {"0/load": 3, "1/prefix": 1}
    assert counter_deltas({}, {}) == {"rank_device_busy_s": None, "routed_requests": None}

    text = format_run(run_doc("a", 1.0, 0.1) | out | grown)
    assert "Replica 1: device idle (sim)" in text and "0/0" in text and "1/prefix" in text
