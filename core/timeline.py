"""The device timeline, kept by the core from every step's StepTiming: idle accounting, a ring
of recent steps for /v1/engine/timeline, and an optional Chrome-trace file."""

from __future__ import annotations

from collections import deque

import msgspec

from gapless.common.config import EngineConfig
from gapless.common.messages import KEEP_STEPS, StepRecord, StepResult, TimelineSummary

# Chrome-trace rows (tid) of one engine
_ROWS = {1: "device", 2: "device idle (work waiting)", 3: "runner: prepare", 4: "core: schedule",
         5: "core: apply result"}  # fmt: skip


def device_label(config: EngineConfig) -> str:
    return f"sim:{config.sim_profile}" if config.device == "sim" else config.device


class DeviceTimeline:
    def __init__(self, config: EngineConfig) -> None:
        self.device = device_label(config)
        self.overlap = config.overlap
        self.steps: deque[StepRecord] = deque(maxlen=KEEP_STEPS)
        self.busy_s = 0.0
        self.idle_s = 0.0
        self._prev_end: float | None = None
        self._work_since: float | None = None  # when the engine last went from empty to busy
        self._trace = TraceWriter(config.trace_file) if config.trace_file else None

    def work_arrived(self, now: float) -> None:
        if self._work_since is None:
            self._work_since = now

    def went_empty(self) -> None:
        self._work_since = None

    def record(
        self,
        *,
        seq: int,
        plan_sent: float,
        schedule_s: float,
        num_tokens: int,
        num_seqs: int,
        num_prefill_tokens: int,
        result: StepResult,
        applied: float,
        apply_s: float,
        num_cached_tokens: int = 0,
    ) -> StepRecord:
        t = result.timing
        assert t is not None, "the runner sends a timing with every result"
        idle, waiting = 0.0, False
        if self._prev_end is not None and self._work_since is not None:
            idle = max(0.0, t.device_start - max(self._prev_end, self._work_since))
            waiting = idle > 0.0
        busy = max(0.0, t.device_end - t.device_start)
        if num_tokens:
            self._prev_end = max(self._prev_end or 0.0, t.device_end)
            self.busy_s += busy
            self.idle_s += idle
        rec = StepRecord(
            seq=seq,
            plan_sent=plan_sent,
            plan_received=t.plan_received,
            launched=t.launched,
            device_start=t.device_start,
            device_end=t.device_end,
            published=t.published,
            result_applied=applied,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            num_prefill_tokens=num_prefill_tokens,
            schedule_ms=schedule_s * 1e3,
            prepare_ms=t.prepare_s * 1e3,
            forward_ms=t.forward_s * 1e3,
            sample_ms=t.sample_s * 1e3,
            apply_ms=apply_s * 1e3,
            idle_before_ms=idle * 1e3,
            waiting=waiting,
            num_cached_tokens=num_cached_tokens,
        )
        self.steps.append(rec)
        if self._trace is not None and num_tokens:
            self._trace.step(rec, idle)
        return rec

    def summary(self) -> TimelineSummary:
        total = self.busy_s + self.idle_s
        return TimelineSummary(self.busy_s, self.idle_s, self.idle_s / total if total else 0.0)

    def last(self, n: int) -> list[StepRecord]:
        n = max(0, min(n, len(self.steps)))
        return list(self.steps)[len(self.steps) - n :]

    def close(self) -> None:
        if self._trace is not None:
            self._trace.close()


class TraceWriter:
    """Chrome trace event format, written as it goes: the array format's closing bracket is
    optional, so a file cut short by a crash still loads in chrome://tracing or Perfetto."""

    def __init__(self, path: str) -> None:
        self._f = open(path, "w", buffering=1 << 16)  # noqa: SIM115 - open for the engine's life
        self._enc = msgspec.json.Encoder()
        self._f.write("[\n")
        for tid, name in _ROWS.items():
            self._event(
                {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}}
            )

    def _event(self, ev: dict) -> None:
        self._f.write(self._enc.encode(ev).decode())
        self._f.write(",\n")

    def _span(self, tid: int, name: str, start: float, end: float, args: dict | None = None):
        ev = {
            "name": name,
            "ph": "X",
            "pid": 1,
            "tid": tid,
            "ts": start * 1e6,
            "dur": max(0.0, end - start) * 1e6,
        }
        if args:
            ev["args"] = args
        self._event(ev)

    def step(self, r: StepRecord, idle: float) -> None:
        args = {"tokens": r.num_tokens, "seqs": r.num_seqs, "prefill": r.num_prefill_tokens}
        if r.num_cached_tokens:
            args["cached"] = r.num_cached_tokens
        self._span(1, f"step {r.seq}", r.device_start, r.device_end, args)
        if idle > 0:
            self._span(2, "idle", r.device_start - idle, r.device_start)
        self._span(3, "prepare", r.plan_received, r.launched)
        self._span(4, "schedule", r.plan_sent - r.schedule_ms / 1e3, r.plan_sent)
        self._span(5, "apply", r.result_applied - r.apply_ms / 1e3, r.result_applied)

    def close(self) -> None:
        self._f.write('{"name": "end", "ph": "i", "pid": 1, "tid": 1, "ts": 0}\n]\n')
        self._f.close()
