"""Prometheus series of every process, and the /metrics rendering.

Under `gapless serve` each child process has PROMETHEUS_MULTIPROC_DIR (set by the supervisor)
before prometheus_client is imported, so every series below is an mmap file per process and a
frontend's /metrics merges all of them. Each role creates only its own series, with
`registry=None` in the processes; tests pass a fresh CollectorRegistry to read them back.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
STAGES = (
    "tokenize",
    "queue_wait",
    "schedule",
    "prepare_inputs",
    "forward",
    "sample",
    "d2h",
    "apply_result",
    "detokenize",
    "stream",
)
FINISH_REASONS = ("stop", "length", "abort", "error")
# why the server closed or refused a connection (frontend/http/transport.py)
CONNECTION_CLOSES = ("header_timeout", "body_timeout", "idle_evicted", "over_capacity")
# s; 10 us to 10 s, ~2.5x apart
STAGE_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
# s; whole requests: 1 ms to 10 min
REQUEST_BUCKETS = (
    1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
    80.0, 160.0, 320.0, 640.0,
)  # fmt: skip


def stage_histogram(registry: CollectorRegistry | None) -> Histogram:
    """`gapless_stage_duration_seconds{stage}`: one histogram, one label value per stage; every
    process creates it and observes its own stages."""
    return Histogram(
        "gapless_stage_duration_seconds",
        "Time spent in one stage of the request path",
        ["stage"],
        buckets=STAGE_BUCKETS,
        registry=registry,
    )


class BatchedHistogram:
    """A histogram (or one labelled child) observed many times per step, e.g. once per streamed
    delta: values wait in a list and go in as one increment per bucket, which under multiprocess
    mode is one mmap write per bucket instead of two per value (the frontend's profile at 64
    streams showed Histogram.observe at 14% of its CPU;
    `pytest tests/core/test_metrics.py -k batched --benchmark-enable` compares the two).

    The list goes in once it holds `max_values`, on the first observation `max_delay_s` after the
    last flush, and on `flush()` (the frontend flushes as each request ends), so /metrics lags
    by at most that. Writes through the histogram's own bucket values; a prometheus_client
    without them gets plain observe() calls.
    """

    def __init__(self, hist: Histogram, max_values: int = 1024, max_delay_s: float = 0.5):
        self._hist = hist
        self._bounds = np.asarray(getattr(hist, "_upper_bounds", ()), dtype=float)
        self._direct = not (hasattr(hist, "_buckets") and hasattr(hist, "_sum"))
        self._values: list[float] = []
        self._max_values = max_values
        self._max_delay_s = max_delay_s
        self._flushed_at = time.monotonic()

    def observe(self, value: float) -> None:
        if self._direct:
            self._hist.observe(value)
            return
        values = self._values
        values.append(value)
        if len(values) >= self._max_values or (
            time.monotonic() - self._flushed_at >= self._max_delay_s
        ):
            self.flush()

    def flush(self) -> None:
        self._flushed_at = time.monotonic()
        if not self._values:
            return
        values = np.asarray(self._values, dtype=float)
        self._values = []
        # bucket i holds the values v with bounds[i-1] < v <= bounds[i] (the last bound is +Inf)
        index = np.searchsorted(self._bounds, values, side="left")
        counts = np.bincount(np.minimum(index, len(self._bounds) - 1))
        buckets = self._hist._buckets  # type: ignore[attr-defined]
        for i in np.flatnonzero(counts):
            buckets[i].inc(int(counts[i]))
        self._hist._sum.inc(float(values.sum()))  # type: ignore[attr-defined]


def rank_busy_counter(replica: int, rank: int, registry: CollectorRegistry | None = None):
    """`gapless_rank_device_busy_seconds{replica,rank}`: device time of the steps one runner
    process ran, every tensor-parallel rank its own (only rank 0's timing reaches the core)."""
    series = Counter(
        "gapless_rank_device_busy_seconds",
        "Device time of the steps each runner rank ran",
        ["replica", "rank"],
        registry=registry,
    )
    return series.labels(str(replica), str(rank))


_bad_frames: Counter | None = None


def write_to(metrics_dir: str) -> None:
    """Make this process's series from now on files in metrics_dir, as a child's are (for the
    supervisor, which imported prometheus_client before its run directory existed)."""
    from prometheus_client import values

    os.environ[MULTIPROC_ENV] = metrics_dir
    values.ValueClass = values.get_value_class()


def bad_frames_counter() -> Counter:
    """`gapless_bad_frames_total{socket}`: frames an internal socket dropped as malformed. One
    per process, in the default registry (multiprocess under `gapless serve`)."""
    global _bad_frames
    if _bad_frames is None:
        _bad_frames = Counter(
            "gapless_bad_frames",
            "Frames an internal socket dropped because they were not a message of its channel",
            ["socket"],
        )
    return _bad_frames


# What a tenant's key reads at /metrics besides the samples labelled with its own tenant: facts
# about the engine's size, never about traffic. Queue lengths, running requests, token totals,
# latencies, KV use and prefix-cache hits all move with other tenants' requests, so they are the
# admin key's (or an open /metrics's).
LORA_MAX_ADAPTERS = "gapless_lora_max_adapters"
TENANT_VISIBLE = frozenset({"gapless_kv_blocks_total", LORA_MAX_ADAPTERS})
# the label core/metrics.py gives the tenants past its bound, all together: nobody's own
OTHER_TENANTS = "other"
# by tenant and LoRA adapter (core/lora_metrics.py); the info gauge below is made from them
LORA_REQUESTS_RUNNING = "gapless_lora_requests_running"
LORA_REQUESTS_WAITING = "gapless_lora_requests_waiting"
LORA_INFO = "gapless_lora_requests_info"


def lora_info(families: dict[str, list]) -> Metric | None:
    """vLLM's lora_requests_info shape, which inference gateways read for adapter-aware
    routing: labels running_lora_adapters and waiting_lora_adapters (adapters with requests
    running, waiting; comma separated) and max_lora; the value is the time it was made (now).
    families: name -> samples of the series it is made from; None without adapters."""
    maxima = families.get(LORA_MAX_ADAPTERS)
    if not maxima:
        return None

    def names(name: str) -> str:
        found = {s.labels["adapter"] for s in families.get(name, ()) if s.value > 0}
        return ",".join(sorted(found))

    info = Metric(LORA_INFO, "LoRA adapters with requests running and waiting, and --max-loras "
                  "(vLLM's lora_requests_info labels); the value is when it was read", "gauge")  # fmt: skip
    labels = {
        "running_lora_adapters": names(LORA_REQUESTS_RUNNING),
        "waiting_lora_adapters": names(LORA_REQUESTS_WAITING),
        "max_lora": str(int(max(s.value for s in maxima))),
    }
    info.add_sample(LORA_INFO, labels, time.time())
    return info


class _View:
    """A collector over another registry's families: constant labels added to every sample;
    with `tenant`, only that tenant's samples and the TENANT_VISIBLE families."""

    def __init__(
        self, source: CollectorRegistry, labels: dict[str, str], tenant: str | None
    ) -> None:
        self.source = source
        self.labels = labels
        self.tenant = tenant

    def collect(self) -> Iterator[Metric]:
        lora: dict[str, list] = {}  # what the LoRA info gauge is made from
        for family in self.source.collect():
            samples = family.samples
            if self.tenant is not None and family.name not in TENANT_VISIBLE:
                samples = [s for s in samples if self._mine(s.labels.get("tenant"))]
                if not samples:
                    continue
            if family.name in (LORA_MAX_ADAPTERS, LORA_REQUESTS_RUNNING, LORA_REQUESTS_WAITING):
                lora[family.name] = samples
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s._replace(labels={**s.labels, **self.labels}) for s in samples]
            yield out
        info = lora_info(lora)
        if info is not None:
            info.samples = [s._replace(labels={**s.labels, **self.labels}) for s in info.samples]
            yield info

    def _mine(self, label: str | None) -> bool:
        # why not "other": that sample sums the tenants past the bound, whoever is named so
        return label is not None and label == self.tenant and label != OTHER_TENANTS


def render(
    registry: CollectorRegistry | None = None,
    model_name: str | None = None,
    tenant: str | None = None,
) -> bytes:
    """The text exposition: every process's files when multiprocess, else `registry`; with
    model_name, every series labelled `model_name` (as dashboards and gateways group them);
    with tenant, only what that tenant may read (its own samples and TENANT_VISIBLE); with
    adapters, the LoRA info gauge made from what it may read (lora_info)."""
    if registry is None:
        registry = CollectorRegistry()
        if os.environ.get(MULTIPROC_ENV):
            MultiProcessCollector(registry)
    labels = {} if model_name is None else {"model_name": model_name}
    view = CollectorRegistry(auto_describe=False)
    view.register(_View(registry, labels, tenant))  # type: ignore[arg-type]
    return generate_latest(view)


class DetokenizerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.detokenize = stage_histogram(registry).labels("detokenize")


class FrontendMetrics:
    """One frontend's series; the multiprocess files of all frontends add up."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry
        stage = stage_histogram(r)
        self.tokenize = stage.labels("tokenize")
        self.stream = stage.labels("stream")
        self.ttft = Histogram(
            "gapless_time_to_first_token_seconds",
            "From the HTTP request's arrival to its first token reaching the frontend",
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "gapless_inter_token_latency_seconds",
            "Gap between a choice's deltas divided by the tokens the later one carries",
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "gapless_e2e_request_latency_seconds",
            "From the HTTP request's arrival to its last delta, for requests that finished",
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.aborted = Counter(
            "gapless_requests_aborted",
            "HTTP requests whose client disconnected before the end",
            registry=r,
        )
        self.admission = Histogram(
            "gapless_admission_decision_seconds",
            "From a request's body received in full to its admission decision (admitted, 429 "
            "or 503); with --max-queued-tokens the decision follows tokenizing",
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        self.rejected = Counter(
            "gapless_requests_rejected",
            "HTTP requests answered with a 4xx, by error code",
            ["reason"],
            registry=r,
        )
        self.connections_closed = Counter(
            "gapless_connections_closed",
            "Connections the server closed or refused: header_timeout, body_timeout, "
            "idle_evicted (at --max-connections, for a new one), over_capacity (503)",
            ["reason"],
            registry=r,
        )
        for reason in CONNECTION_CLOSES:  # exported at 0 before the first
            self.connections_closed.labels(reason)
        self.connections = Gauge(
            "gapless_connections_open", "HTTP connections open, over every frontend",
            multiprocess_mode="livesum", registry=r,
        )  # fmt: skip
        self.slow_clients = Counter(
            "gapless_slow_clients",
            "Streams aborted because the client stopped reading: buffer (too many events "
            "unsent) or write_timeout",
            ["reason"],
            registry=r,
        )
        for reason in ("buffer", "write_timeout"):  # exported at 0 before the first
            self.slow_clients.labels(reason)
