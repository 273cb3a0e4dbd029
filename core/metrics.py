"""The core process's Prometheus series: per-step stages (the runner's from its StepTiming),
device busy and idle, queue and KV gauges, and requests by how they ended."""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gapless.common.metrics import FINISH_REASONS, REQUEST_BUCKETS, stage_histogram
from gapless.core.spec_metrics import SpecMetrics

if TYPE_CHECKING:
    from gapless.common.messages import StepTiming
    from gapless.core.request import Request
    from gapless.core.scheduler import ScheduledStep, Scheduler
    from gapless.core.timeline import DeviceTimeline

IDLE_WINDOW_S = 10.0  # the idle-fraction gauge covers the steps of the last 10 s of device time
HIT_RATE_WINDOW_S = 60.0  # the prefix-cache hit-rate gauge covers the admissions of the last 60 s
MAX_TENANT_LABELS = 20  # tenants with a label of their own; the rest are "other"


class IdleWindow:
    """Busy and idle device seconds of the steps that ended in the last `span_s` seconds."""

    def __init__(self, span_s: float = IDLE_WINDOW_S) -> None:
        self.span_s = span_s
        self._steps: deque[tuple[float, float, float]] = deque()  # (device_end, busy s, idle s)
        self.busy_s = 0.0
        self.idle_s = 0.0

    def add(self, end: float, busy: float, idle: float) -> float:
        """Adds one step; returns the idle fraction over the window."""
        steps = self._steps
        steps.append((end, busy, idle))
        self.busy_s += busy
        self.idle_s += idle
        while steps and steps[0][0] < end - self.span_s:
            _, b, i = steps.popleft()
            self.busy_s -= b
            self.idle_s -= i
        total = self.busy_s + self.idle_s
        return max(0.0, self.idle_s) / total if total > 0 else 0.0


class ReplicaSeries:
    """`gapless_replica_*{replica}`: one engine replica's queues, KV use and device time (the
    unlabelled series add up, or take the fullest of, every replica's)."""

    def __init__(self, r: CollectorRegistry | None, replica: str) -> None:
        def gauge(name: str, doc: str) -> Gauge:
            series = Gauge(name, doc, ["replica"], multiprocess_mode="livemostrecent", registry=r)
            return series.labels(replica)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["replica"], registry=r).labels(replica)

        self.running = gauge("gapless_replica_requests_running", "Requests holding a batch slot")
        self.waiting = gauge(
            "gapless_replica_requests_waiting", "Requests queued for a slot (preempted included)"
        )
        self.kv_usage = gauge(
            "gapless_replica_kv_cache_usage_ratio", "Share of the KV cache held by requests"
        )
        self.busy = counter("gapless_replica_device_busy_seconds", "Device time running steps")
        self.idle = counter(
            "gapless_replica_device_idle_seconds",
            "Device time idle between steps while requests were waiting or running",
        )


class CoreMetrics:
    """The core's series: stages of a step (the runner's from its StepTiming), device busy and
    idle, queue gauges, and request counts by how they ended."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        known_tenants: tuple[str, ...] = (),
        replica: int = 0,
    ) -> None:
        r = registry
        self.registry = registry  # None: the default one
        stage = stage_histogram(r)
        self.queue_wait = stage.labels("queue_wait")
        self.schedule = stage.labels("schedule")
        self.prepare = stage.labels("prepare_inputs")
        self.forward = stage.labels("forward")
        self.sample = stage.labels("sample")
        self.d2h = stage.labels("d2h")
        self.apply = stage.labels("apply_result")
        self.queue_time = Histogram(
            "gapless_queue_time_seconds",
            "From the HTTP request's arrival to its first scheduled step",
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.busy = Counter(
            "gapless_device_busy_seconds", "Device time spent running steps", registry=r
        )
        self.idle = Counter(
            "gapless_device_idle_seconds",
            "Device time idle between steps while requests were waiting or running",
            registry=r,
        )
        # why these modes: with --data-parallel-size every replica's core sets its own value;
        # counts add up over them, and a share reads as the fullest (or idlest) replica's. The
        # gapless_replica_* series below tell the replicas apart
        mode, share = "livesum", "livemax"
        self.idle_fraction = Gauge(
            "gapless_device_idle_fraction",
            f"Idle / (busy + idle) over the steps of the last {IDLE_WINDOW_S:g} s",
            multiprocess_mode=share,
            registry=r,
        )
        self.running = Gauge(
            "gapless_requests_running", "Requests holding a batch slot",
            multiprocess_mode=mode, registry=r,
        )  # fmt: skip
        self.waiting = Gauge(
            "gapless_requests_waiting", "Requests queued for a slot (preempted ones included)",
            multiprocess_mode=mode, registry=r,
        )  # fmt: skip
        self.blocks_used = Gauge(
            "gapless_kv_blocks_used", "KV cache blocks held by requests",
            multiprocess_mode=mode, registry=r,
        )  # fmt: skip
        self.blocks_total = Gauge(
            "gapless_kv_blocks_total", "KV cache blocks that requests can hold",
            multiprocess_mode=mode, registry=r,
        )  # fmt: skip
        self.kv_usage = Gauge(
            "gapless_kv_cache_usage_ratio",
            "Share of the KV cache held by requests, 0 to 1 (what inference gateways read)",
            multiprocess_mode=share, registry=r,
        )  # fmt: skip
        self._finished = Counter(
            "gapless_requests_finished",
            "Engine requests (one per choice) that ended, by finish reason",
            ["finish_reason"],
            registry=r,
        )
        self.finished = {reason: self._finished.labels(reason) for reason in FINISH_REASONS}
        self._cache_config = Gauge(
            "gapless_cache_config_info",
            "The KV cache's shape as labels (vLLM's cache_config_info label names, which "
            "inference gateways read): tokens per block, blocks; the value is 1",
            ["block_size", "num_gpu_blocks"],
            multiprocess_mode=share,
            registry=r,
        )
        self.kv_events_dropped = Counter(
            "gapless_kv_events_dropped_batches",
            "KV event batches dropped because the publisher's queue was full (a subscriber "
            "sees the gap in sequence numbers)",
            registry=r,
        )
        self.stalls = Counter(
            "gapless_engine_stalls",
            "Times a step's result was owed past the stall bound (--stall-timeout)",
            registry=r,
        )
        self.spec = SpecMetrics(r)
        self.preemptions = Counter(
            "gapless_preemptions", "Running requests preempted for KV blocks", registry=r
        )
        self.prompt_tokens = Counter(
            "gapless_prompt_tokens", "Prompt tokens of requests the engine accepted", registry=r
        )
        self.generation_tokens = Counter(
            "gapless_generation_tokens", "Tokens sampled for live requests", registry=r
        )
        self.prefix_queried = Counter(
            "gapless_prefix_cache_queried_tokens",
            "Tokens looked up in the prefix cache when requests took a seat",
            registry=r,
        )
        self.prefix_hit = Counter(
            "gapless_prefix_cache_hit_tokens",
            "Tokens found in the prefix cache (their KV was not computed again)",
            registry=r,
        )
        self.prefix_evictions = Counter(
            "gapless_prefix_cache_evictions",
            "Cached KV blocks no request held, reused for other content",
            registry=r,
        )
        self.prefix_hit_rate = Gauge(
            "gapless_prefix_cache_hit_rate",
            f"Hit tokens / queried tokens over the admissions of the last {HIT_RATE_WINDOW_S:g} s",
            multiprocess_mode=share,
            registry=r,
        )
        self.blocks_cached = Gauge(
            "gapless_kv_blocks_cached", "KV blocks holding a cached prefix that no request holds",
            multiprocess_mode=mode, registry=r,
        )  # fmt: skip
        self.tenant_waiting = Gauge(
            "gapless_tenant_requests_waiting", "Requests waiting for a seat, by tenant",
            ["tenant"], multiprocess_mode=mode, registry=r,
        )  # fmt: skip
        self.priority_waiting = Gauge(
            "gapless_priority_requests_waiting", "Requests waiting for a seat, by priority",
            ["priority"], multiprocess_mode=mode, registry=r,
        )  # fmt: skip
        self.tenant_tokens = Counter(
            "gapless_tenant_service_tokens",
            "Tokens served per tenant: prompt tokens computed (once each), outputs sampled",
            ["tenant", "kind"],
            registry=r,
        )
        self.replica = ReplicaSeries(r, str(replica))
        self.decisions = Counter(
            "gapless_scheduler_decisions",
            "Scheduling policy choices: aged (admitted after waiting --priority-aging or longer), "
            "preempt_priority (for a request of a lower priority number), preempt_kv",
            ["decision"],
            registry=r,
        )
        for decision in ("aged", "preempt_priority", "preempt_kv"):  # exported at 0 from the start
            self.decisions.labels(decision)
        # tenant -> its label: configured tenants first, then the first seen, up to the bound
        self._labels = {t: t for t in known_tenants[:MAX_TENANT_LABELS]}
        self._served = (np.zeros(0, np.int64), np.zeros(0, np.int64))  # counted so far
        self._waiting_labels: set[str] = set()
        self._priorities: set[int] = set()
        self._decided = (0, 0, 0)  # (aged, preempt_priority, preempt_kv) counted so far
        self._window = IdleWindow()
        self._arrived: dict[str, float] = {}  # request id -> perf_counter in the core, until run
        self._busy_s = self._idle_s = 0.0  # the timeline's totals already counted
        self._preemptions = 0
        self._queues = (-1, -1, -1, -1)  # last (running, waiting, used, total) set
        self._prefix = (0, 0, 0, -1)  # last (queried, hit, evictions, cached free) counted
        # (monotonic, tokens queried, hit) per change over the last HIT_RATE_WINDOW_S, summed
        self._hits: deque[tuple[float, int, int]] = deque()
        self._window_q = self._window_h = 0

    def cache_config(self, block_size: int, num_blocks: int) -> None:
        """Export the cache's shape once, when the engine starts."""
        self._cache_config.labels(str(block_size), str(num_blocks)).set(1)

    # requests -----------------------------------------------------------------------------

    def request_added(self, request_id: str, num_prompt_tokens: int, now: float) -> None:
        self._arrived[request_id] = now
        self.prompt_tokens.inc(num_prompt_tokens)

    def request_ended(self, request_id: str, reason: str) -> None:
        """A request finished outside a step's result (abort, stop string, refused)."""
        self._arrived.pop(request_id, None)
        self._count_finish(reason)

    def _count_finish(self, reason: str) -> None:
        child = self.finished.get(reason)
        if child is None:
            child = self.finished[reason] = self._finished.labels(reason)
        child.inc()

    # steps --------------------------------------------------------------------------------

    def step_planned(self, step: ScheduledStep, running: list[Request]) -> None:
        """After a plan is sent: its schedule time, and the queue wait of requests it starts."""
        self.schedule.observe(step.schedule_s)
        new_slots = step.plan.new_slots
        if not new_slots or not self._arrived:
            return
        now, wall = step.plan_sent, time.time()
        slots = {s.slot for s in new_slots}
        for req in running:
            if req.slot in slots:
                arrived = self._arrived.pop(req.request_id, None)
                if arrived is not None:  # None: a preempted request coming back
                    self.queue_wait.observe(now - arrived)
                    self.queue_time.observe(max(0.0, wall - req.arrival_time))

    def step_applied(
        self,
        timing: StepTiming,
        apply_s: float,
        timeline: DeviceTimeline,
        finish_reasons: list[str],
        num_tokens: int,
    ) -> None:
        """After a result is applied and recorded in the timeline."""
        self.prepare.observe(timing.prepare_s)
        self.forward.observe(timing.forward_s)
        self.sample.observe(timing.sample_s)
        self.d2h.observe(max(0.0, timing.published - timing.device_end))
        self.apply.observe(apply_s)
        busy, idle = timeline.busy_s - self._busy_s, timeline.idle_s - self._idle_s
        if busy > 0.0 or idle > 0.0:  # steps without tokens do not count on the device
            self._busy_s, self._idle_s = timeline.busy_s, timeline.idle_s
            self.busy.inc(busy)
            self.replica.busy.inc(busy)
            if idle > 0.0:
                self.idle.inc(idle)
                self.replica.idle.inc(idle)
            self.idle_fraction.set(self._window.add(timing.device_end, busy, idle))
        if num_tokens:
            self.generation_tokens.inc(num_tokens)
        if len(finish_reasons) != finish_reasons.count(""):
            for reason in finish_reasons:
                if reason:
                    self._count_finish(reason)

    def observe_queues(self, scheduler: Scheduler) -> None:
        """Queue and KV gauges (written only when they changed) and the preemption count."""
        if scheduler.num_preemptions != self._preemptions:
            self.preemptions.inc(scheduler.num_preemptions - self._preemptions)
            self._preemptions = scheduler.num_preemptions
        blocks = scheduler.blocks
        prefix = (
            scheduler.num_queried_tokens,
            scheduler.num_hit_tokens,
            blocks.num_evictions,
            blocks.num_cached_free,
        )
        if prefix != self._prefix:
            self._observe_prefix(prefix)
        now = (
            len(scheduler.running),
            scheduler.num_waiting,
            blocks.num_usable - blocks.num_free,
            blocks.num_usable,
        )
        if now == self._queues:
            return
        last, self._queues = self._queues, now
        if now[2:] != last[2:]:
            usage = now[2] / now[3] if now[3] else 0.0
            self.kv_usage.set(usage)
            self.replica.kv_usage.set(usage)
        if now[:2] != last[:2]:
            self.replica.running.set(now[0])
            self.replica.waiting.set(now[1])
        for gauge, value, old in zip(
            (self.running, self.waiting, self.blocks_used, self.blocks_total),
            now,
            last,
            strict=True,
        ):
            if value != old:
                gauge.set(value)

    def _observe_prefix(self, now: tuple[int, int, int, int]) -> None:
        queried, hit, evictions, cached_free = now
        last, self._prefix = self._prefix, now
        if evictions > last[2]:
            self.prefix_evictions.inc(evictions - last[2])
        if cached_free != last[3]:
            self.blocks_cached.set(cached_free)
        if queried == last[0]:
            return
        self.prefix_queried.inc(queried - last[0])
        if hit > last[1]:
            self.prefix_hit.inc(hit - last[1])
        dq, dh = queried - last[0], hit - last[1]
        t, window = time.monotonic(), self._hits
        window.append((t, dq, dh))
        self._window_q += dq
        self._window_h += dh
        while window[0][0] < t - HIT_RATE_WINDOW_S:
            _, oq, oh = window.popleft()
            self._window_q -= oq
            self._window_h -= oh
        self.prefix_hit_rate.set(self._window_h / self._window_q if self._window_q else 0.0)

    # tenants ------------------------------------------------------------------------------

    def tenant_label(self, tenant: str) -> str:
        label = self._labels.get(tenant)
        if label is None:  # past the bound nothing is stored: any tenant name is one of them
            if len(self._labels) >= MAX_TENANT_LABELS:
                return "other"
            label = self._labels[tenant] = tenant
        return label

    def observe_tenants(
        self,
        tenant_waiting: list[dict[str, int]],
        priority_waiting: dict[int, int],
        scheduler: Scheduler,
    ) -> None:
        """Per-tenant and per-priority queue depth, tokens served and policy choices; called
        when the waiting queue changed, at most every QUEUE_STATE_INTERVAL_S."""
        waiting: dict[str, int] = dict.fromkeys(self._waiting_labels, 0)
        for per_frontend in tenant_waiting:
            for tenant, n in per_frontend.items():
                label = self.tenant_label(tenant)
                waiting[label] = waiting.get(label, 0) + n
        for label, n in waiting.items():
            self.tenant_waiting.labels(label).set(n)
        self._waiting_labels = {label for label, n in waiting.items() if n}
        for priority in self._priorities | set(priority_waiting):
            self.priority_waiting.labels(str(priority)).set(priority_waiting.get(priority, 0))
        self._priorities = set(priority_waiting)
        policy = scheduler.policy
        served = (policy.prompt_tokens, policy.output_tokens)
        for kind, now, before in zip(("prompt", "output"), served, self._served, strict=True):
            grown = now - np.pad(before, (0, len(now) - len(before)))  # [T] tokens since last
            for t in np.flatnonzero(grown).tolist():
                label = self.tenant_label(policy.tenants[t])
                self.tenant_tokens.labels(label, kind).inc(int(grown[t]))
        self._served = (policy.prompt_tokens.copy(), policy.output_tokens.copy())
        decided = (
            policy.num_aged,
            scheduler.num_priority_preemptions,
            scheduler.num_preemptions - scheduler.num_priority_preemptions,
        )
        for name, now_n, before_n in zip(
            ("aged", "preempt_priority", "preempt_kv"), decided, self._decided, strict=True
        ):
            if now_n > before_n:
                self.decisions.labels(name).inc(now_n - before_n)
        self._decided = decided
