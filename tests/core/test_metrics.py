"""/metrics: the series each process writes, their merge across processes, and a whole server
under load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client import values as prometheus_values
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from gapless.common.messages import NewSlot, SamplingParams, StepPlan, StepResult, StepTiming
from gapless.common.metrics import (
    STAGE_BUCKETS,
    STAGES,
    BatchedHistogram,
    DetokenizerMetrics,
    FrontendMetrics,
    render,
)
from gapless.core.metrics import CoreMetrics
from gapless.core.scheduler import ScheduledStep
from gapless.core.timeline import DeviceTimeline
from tests.server import ROOT, Server

PARAMS = SamplingParams(max_tokens=4)


def _timeline() -> DeviceTimeline:
    config = SimpleNamespace(device="cpu", sim_profile="", overlap=True, trace_file=None)
    return DeviceTimeline(config)  # type: ignore[arg-type]


def _plan(seq: int, new_slots: list[int]) -> StepPlan:
    return StepPlan(
        seq=seq,
        new_slots=[NewSlot(slot=s, params=PARAMS, num_prompt_tokens=3) for s in new_slots],
        freed_slots=[],
        slots=[],
        num_tokens=[],
        start_pos=[],
        has_tokens=[],
        token_ids=[],
        sample=[],
        num_new_blocks=[],
        new_blocks=[],
    )


def _result(seq: int, start: float, end: float) -> StepResult:
    timing = StepTiming(
        plan_received=start - 0.002,
        launched=start - 0.001,
        device_start=start,
        device_end=end,
        published=end + 0.0005,
        prepare_s=0.001,
        forward_s=end - start,
        sample_s=0.0002,
    )
    return StepResult(seq, [7], timing=timing)


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_every_series_renders() -> None:
    text = b""
    for make in (CoreMetrics, DetokenizerMetrics, FrontendMetrics):
        registry = CollectorRegistry()
        make(registry)
        text += render(registry)
    names = {f.name for f in text_string_to_metric_families(text.decode())}
    assert all(n.startswith("gapless_") for n in names)
    assert {
        "gapless_stage_duration_seconds",
        "gapless_device_busy_seconds",
        "gapless_device_idle_seconds",
        "gapless_device_idle_fraction",
        "gapless_requests_running",
        "gapless_requests_waiting",
        "gapless_kv_blocks_used",
        "gapless_kv_blocks_total",
        "gapless_time_to_first_token_seconds",
        "gapless_inter_token_latency_seconds",
        "gapless_e2e_request_latency_seconds",
        "gapless_queue_time_seconds",
        "gapless_requests_finished",
        "gapless_requests_aborted",
        "gapless_preemptions",
        "gapless_requests_rejected",
        "gapless_prompt_tokens",
        "gapless_generation_tokens",
    } <= names
    assert b"gapless_requests_finished_total" in text and b"gapless_preemptions_total" in text


def test_core_steps_move_stages_device_time_and_counts() -> None:
    registry = CollectorRegistry()
    m = CoreMetrics(registry)
    timeline = _timeline()
    req = SimpleNamespace(request_id="r", slot=3, arrival_time=time.time() - 0.5)
    m.request_added("r", 5, now=10.0)
    m.request_added("gone", 2, now=10.0)
    m.request_ended("gone", "abort")  # aborted while waiting: no queue wait observed

    step = ScheduledStep(_plan(1, [3]), [], plan_sent=10.25, schedule_s=0.0001)
    m.step_planned(step, [req])  # type: ignore[list-item]
    assert _value(registry, "gapless_stage_duration_seconds_count", stage="queue_wait") == 1
    assert _value(registry, "gapless_stage_duration_seconds_sum", stage="queue_wait") == 0.25
    assert _value(registry, "gapless_queue_time_seconds_count") == 1
    assert _value(registry, "gapless_queue_time_seconds_sum") >= 0.5
    # the same request scheduled again after a preemption is not a new queue wait
    m.step_planned(ScheduledStep(_plan(2, [3]), [], plan_sent=11.0), [req])  # type: ignore[list-item]
    assert _value(registry, "gapless_stage_duration_seconds_count", stage="queue_wait") == 1
    assert _value(registry, "gapless_stage_duration_seconds_count", stage="schedule") == 2

    # two steps with 4 ms of device time each and 1 ms idle between them, work waiting
    timeline.work_arrived(99.0)
    for seq, (start, end) in enumerate([(100.0, 100.004), (100.005, 100.009)], 1):
        result = _result(seq, start, end)
        timeline.record(
            seq=seq, plan_sent=start - 0.003, schedule_s=0.0001, num_tokens=1, num_seqs=1,
            num_prefill_tokens=0, result=result, applied=end + 0.001, apply_s=0.0003,
        )  # fmt: skip
        assert result.timing is not None
        m.step_applied(result.timing, 0.0003, timeline, ["length" if seq == 2 else ""], 1)
    for stage in ("prepare_inputs", "forward", "sample", "d2h", "apply_result"):
        assert _value(registry, "gapless_stage_duration_seconds_count", stage=stage) == 2, stage
    d2h = _value(registry, "gapless_stage_duration_seconds_sum", stage="d2h")
    assert d2h == pytest.approx(0.001)
    assert _value(registry, "gapless_device_busy_seconds_total") == pytest.approx(0.008)
    assert _value(registry, "gapless_device_idle_seconds_total") == pytest.approx(0.001)
    assert _value(registry, "gapless_device_idle_fraction") == pytest.approx(1 / 9)
    assert _value(registry, "gapless_generation_tokens_total") == 2
    assert _value(registry, "gapless_prompt_tokens_total") == 7
    assert _value(registry, "gapless_requests_finished_total", finish_reason="length") == 1
    assert _value(registry, "gapless_requests_finished_total", finish_reason="abort") == 1
    assert _value(registry, "gapless_requests_finished_total", finish_reason="stop") == 0


def test_idle_fraction_forgets_old_steps() -> None:
    registry = CollectorRegistry()
    m = CoreMetrics(registry)
    timeline = _timeline()
    timeline.work_arrived(0.0)
    # an idle-heavy start, then 20 s of back-to-back steps: the window sees only the latter
    t = 1.0
    for seq in range(1, 202):
        start = t + (0.9 if seq == 2 else 0.0)
        result = _result(seq, start, start + 0.1)
        timeline.record(
            seq=seq, plan_sent=start, schedule_s=0.0, num_tokens=1, num_seqs=1,
            num_prefill_tokens=0, result=result, applied=start + 0.1, apply_s=0.0,
        )  # fmt: skip
        assert result.timing is not None
        m.step_applied(result.timing, 0.0, timeline, [""], 1)
        t = start + 0.1
    assert _value(registry, "gapless_device_idle_seconds_total") == pytest.approx(0.9)
    assert _value(registry, "gapless_device_idle_fraction") == 0.0


def test_queue_gauges_and_preemptions() -> None:
    registry = CollectorRegistry()
    m = CoreMetrics(registry)
    blocks = SimpleNamespace(num_free=90, num_usable=100, num_evictions=0, num_cached_free=4)
    sched = SimpleNamespace(
        running=[1, 2],
        num_waiting=1,
        blocks=blocks,
        num_preemptions=0,
        num_queried_tokens=100,
        num_hit_tokens=25,
    )
    m.observe_queues(sched)  # type: ignore[arg-type]
    assert _value(registry, "gapless_prefix_cache_queried_tokens_total") == 100
    assert _value(registry, "gapless_prefix_cache_hit_tokens_total") == 25
    assert _value(registry, "gapless_prefix_cache_hit_rate") == 0.25
    assert _value(registry, "gapless_kv_blocks_cached") == 4
    assert _value(registry, "gapless_requests_running") == 2
    assert _value(registry, "gapless_requests_waiting") == 1
    assert _value(registry, "gapless_kv_blocks_used") == 10
    assert _value(registry, "gapless_kv_blocks_total") == 100
    sched.running, sched.num_waiting, sched.num_preemptions = [], 0, 3
    blocks.num_free = 100
    m.observe_queues(sched)  # type: ignore[arg-type]
    assert _value(registry, "gapless_requests_running") == 0
    assert _value(registry, "gapless_kv_blocks_used") == 0
    assert _value(registry, "gapless_preemptions_total") == 3
    sched.num_queried_tokens, sched.num_hit_tokens, blocks.num_evictions = 300, 225, 7
    m.observe_queues(sched)  # type: ignore[arg-type]
    assert _value(registry, "gapless_prefix_cache_hit_tokens_total") == 225
    assert _value(registry, "gapless_prefix_cache_hit_rate") == 0.75, "over the last 60 s"
    assert _value(registry, "gapless_prefix_cache_evictions_total") == 7


_WRITER = """
import sys
from gapless.common.metrics import FrontendMetrics
from gapless.core.metrics import CoreMetrics
role = sys.argv[1]
if role == "core":
    m = CoreMetrics()
    m.request_ended("x", "stop")
    m.schedule.observe(0.001)
    m.running.set(3)
else:
    m = FrontendMetrics()
    m.tokenize.observe(0.002)
    m.rejected.labels("invalid_json").inc()
"""


def test_processes_merge_through_the_multiprocess_dir(tmp_path) -> None:
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    for role in ("core", "frontend", "frontend"):
        subprocess.run(
            [sys.executable, "-c", textwrap.dedent(_WRITER), role], cwd=ROOT, env=env, check=True
        )
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from gapless.common.metrics import render; "
         "sys.stdout.write(render().decode())"],
        cwd=ROOT, env=env, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    samples = _samples(out)
    assert samples[("gapless_stage_duration_seconds_count", (("stage", "tokenize"),))] == 2
    assert samples[("gapless_stage_duration_seconds_count", (("stage", "schedule"),))] == 1
    assert samples[("gapless_requests_rejected_total", (("reason", "invalid_json"),))] == 2
    assert samples[("gapless_requests_finished_total", (("finish_reason", "stop"),))] == 1
    assert samples[("gapless_requests_running", ())] == 3


def _two_histograms(registry: CollectorRegistry | None = None) -> tuple[Histogram, Histogram]:
    return tuple(  # type: ignore[return-value]
        Histogram(name, "h", ["stage"], buckets=STAGE_BUCKETS, registry=registry).labels("x")
        for name in ("direct_seconds", "batched_seconds")
    )


# values on every bound, between them, below the first and past the last (+Inf)
_VALUES = [*STAGE_BUCKETS, *(b * 1.5 for b in STAGE_BUCKETS), 0.0, 1e-7, 11.0, 1e6]


def _by_name(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
    }


def test_batched_histogram_counts_as_observe_does() -> None:
    registry = CollectorRegistry()
    direct, batched_hist = _two_histograms(registry)
    batched = BatchedHistogram(batched_hist, max_values=7, max_delay_s=3600)
    for v in _VALUES * 3:
        direct.observe(v)
        batched.observe(v)
    batched.flush()
    samples = _by_name(registry)
    want = {k: v for k, v in samples.items() if k[0].startswith("direct_seconds_")}
    got = {
        (k[0].replace("batched", "direct"), k[1]): v
        for k, v in samples.items()
        if k[0].startswith("batched_seconds_")
    }
    assert got == pytest.approx(want)
    assert want[("direct_seconds_count", (("stage", "x"),))] == 3 * len(_VALUES)


def test_batched_histogram_flushes_by_size_and_by_age() -> None:
    registry = CollectorRegistry()
    _, hist = _two_histograms(registry)
    count = lambda: registry.get_sample_value("batched_seconds_count", {"stage": "x"})  # noqa: E731
    by_size = BatchedHistogram(hist, max_values=3, max_delay_s=3600)
    by_size.observe(0.1)
    by_size.observe(0.2)
    assert count() == 0  # waiting in the list
    by_size.observe(0.3)
    assert count() == 3
    by_age = BatchedHistogram(hist, max_values=1000, max_delay_s=0.0)
    by_age.observe(0.4)
    assert count() == 4


@pytest.mark.parametrize("how", ["observe", "batched"])
def test_bench_histogram_under_multiprocess_mode(benchmark, how, tmp_path, monkeypatch) -> None:
    """One observation with mmap-backed values, as every served process has them."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(prometheus_values, "ValueClass", prometheus_values.MultiProcessValue())
    hist = Histogram("b_seconds", "b", buckets=STAGE_BUCKETS, registry=CollectorRegistry())
    observe = hist.observe if how == "observe" else BatchedHistogram(hist).observe
    benchmark(observe, 0.003)
    if how == "batched":
        observe.__self__.flush()  # type: ignore[attr-defined]
    assert hist._sum.get() > 0  # type: ignore[attr-defined]  # the mmap file has them


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


# ------------------------------------------------------------------------- a whole server


@pytest.mark.slow
def test_metrics_of_a_loaded_server_with_two_frontends(tiny_model_dir) -> None:
    num_requests, max_tokens = 16, 32
    s = Server(
        "--model", str(tiny_model_dir), "--dtype", "float32", "--served-model-name", "tiny",
        "--api-servers", "2",
    )  # fmt: skip
    try:
        body = {
            "model": "tiny", "prompt": "measure it", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True,
        }  # fmt: skip
        # several connections: SO_REUSEPORT spreads them over both frontends
        barrier = threading.Barrier(num_requests)
        finishes: list[str] = []

        def one() -> None:
            with httpx.Client(timeout=60) as c:
                barrier.wait()
                with c.stream("POST", s.url + "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    lines = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
                    finishes.append(json.loads(lines[-1][6:])["choices"][0]["finish_reason"])

        threads = [threading.Thread(target=one) for _ in range(num_requests)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert finishes == ["length"] * num_requests

        # the run's device span: first step's start to last step's end
        steps = httpx.get(s.url + "/v1/engine/timeline?last=8192", timeout=10).json()["steps"]
        steps = [st for st in steps if st["num_tokens"]]
        span = steps[-1]["device_end"] - steps[0]["device_start"]

        scrapes = [_scrape(s.url) for _ in range(8)]  # both frontends, by the kernel's choice
        time.sleep(0.3)  # the gauges follow the core's loop (<= 100 ms when idle)
        m = _scrape(s.url)
        for stage in STAGES:
            key = ("gapless_stage_duration_seconds_count", (("stage", stage),))
            assert m.get(key, 0) > 0, f"no observation of stage {stage}"
        busy = m[("gapless_device_busy_seconds_total", ())]
        idle = m[("gapless_device_idle_seconds_total", ())]
        assert abs(busy + idle - span) <= 0.05 * span, (busy, idle, span)
        assert m[("gapless_requests_running", ())] == 0
        assert m[("gapless_requests_waiting", ())] == 0
        assert m[("gapless_kv_blocks_used", ())] == 0 and m[("gapless_kv_blocks_total", ())] > 0
        assert m[("gapless_kv_cache_usage_ratio", ())] == 0
        finished = (("finish_reason", "length"),)
        assert m[("gapless_requests_finished_total", finished)] == num_requests
        assert m[("gapless_generation_tokens_total", ())] == num_requests * max_tokens
        for name in (
            "gapless_time_to_first_token_seconds_count",
            "gapless_e2e_request_latency_seconds_count",
            "gapless_queue_time_seconds_count",
        ):
            assert m[(name, ())] == num_requests, name
        assert m[("gapless_inter_token_latency_seconds_count", ())] > 0
        # every scrape, whichever frontend answered, shows the same request totals
        keys = [k for k in m if k[0].endswith(("_total", "_count")) and "device" not in k[0]]
        keys = [
            k
            for k in keys
            if k[0] not in ("gapless_requests_rejected_total", "gapless_bad_frames_total")
        ]
        for other in scrapes:
            assert {k: other.get(k) for k in keys} == {k: m[k] for k in keys}
        per_frontend = _ttft_counts_per_frontend(s)
        assert len(per_frontend) == 2 and sum(per_frontend) == num_requests
        assert min(per_frontend) > 0, "SO_REUSEPORT spread the connections over both frontends"
    finally:
        assert s.stop() == 0, s.read_log()


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    # a new connection each time, so SO_REUSEPORT may pick either frontend
    r = httpx.get(url + "/metrics", timeout=10, headers={"connection": "close"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = _samples(r.text)
    # every series is labelled with the served model; the rest of the test reads them without
    assert samples and all(("model_name", "tiny") in labels for _, labels in samples)
    return {
        (name, tuple(kv for kv in labels if kv[0] != "model_name")): value
        for (name, labels), value in samples.items()
    }


def _ttft_counts_per_frontend(s: Server) -> list[float]:
    """How many first tokens each frontend saw, from its own file in the metrics directory."""
    run_dir = s.run_dir()
    assert run_dir is not None
    pids = sorted(pid for name, pid in s.child_pids().items() if name.startswith("gapless-front"))
    counts = []
    for pid in pids:
        path = os.path.join(run_dir, "metrics", f"histogram_{pid}.db")
        (family,) = [
            f
            for f in MultiProcessCollector.merge([path])
            if f.name == "gapless_time_to_first_token_seconds"
        ]
        counts.append(sum(x.value for x in family.samples if x.name.endswith("_count")))
    return counts
