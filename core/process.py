"""The core process: owns the ZMQ sockets around the in-process EngineCore."""

from __future__ import annotations

import logging
import time

import zmq

from gapless.common.channel import Publisher, Receiver, Sender
from gapless.common.config import EngineConfig
from gapless.common.messages import (
    HEARTBEAT_INTERVAL_S,
    AdapterRead,
    CoreInput,
    DetokInput,
    FrontendInput,
    Heartbeat,
    RunnerError,
    RunnerInput,
    RunnerOutput,
    RunnerReady,
    Shutdown,
    StepRefused,
    StepResult,
)
from gapless.common.process import (
    CORE_IN,
    DETOK_IN,
    RUNNER_IN,
    RUNNER_OUT,
    ControlReporter,
    frontend_socket,
    plan_endpoints,
    stop_requested,
)
from gapless.core.engine import EngineCore, EngineOutputs
from gapless.core.kv_publisher import KvEventPublisher

log = logging.getLogger("gapless.core")

IDLE_POLL_MS = 100  # how long to block with nothing to do before looking at stop_requested()


class StatsLine:
    """A periodic log line while the engine has work: running, waiting, KV use, tok/s, idle %,
    and how many steps the core plans ahead now."""

    def __init__(self, core: EngineCore, interval_s: float) -> None:
        self.core = core
        self.interval_s = interval_s
        self.num_tokens = 0  # sampled tokens applied since the last line
        self._at = time.monotonic()
        self._busy_idle = (0.0, 0.0)  # the device timeline's totals at the last line

    def maybe_log(self, now: float) -> None:
        if self.interval_s <= 0 or now - self._at < self.interval_s:
            return
        s, tl = self.core.scheduler, self.core.timeline
        busy, idle = tl.busy_s - self._busy_idle[0], tl.idle_s - self._busy_idle[1]
        if s.has_work or self.num_tokens:
            blocks = s.blocks
            used = blocks.num_usable - blocks.num_free
            fields = {
                "running": len(s.running),
                "waiting": s.num_waiting,
                "kv_used": round(used / max(1, blocks.num_usable), 3),
                "tok_per_s": round(self.num_tokens / (now - self._at), 1),
                "idle_pct": round(100 * idle / (busy + idle), 1) if busy + idle > 0 else 0.0,
                "steps_ahead": self.core.depth,
            }
            log.info("stats", extra={"fields": fields})
        self._at, self.num_tokens = now, 0
        self._busy_idle = (tl.busy_s, tl.idle_s)


class CoreProcess:
    """Moves messages between the sockets and the EngineCore; no scheduling logic here."""

    def __init__(
        self,
        core: EngineCore,
        ctx: zmq.Context,
        results: Receiver[RunnerOutput],
        runner: Sender[RunnerInput] | Publisher[RunnerInput] | None = None,
    ) -> None:
        config = core.config
        self.core = core
        self.inbox: Receiver[CoreInput] = Receiver(ctx, config.engine_ipc(CORE_IN), CoreInput)
        self.results = results
        self.runner = runner or plan_sender(ctx, config)
        self.detok: Sender[DetokInput] = Sender(ctx, config.engine_ipc(DETOK_IN), shm=True)
        self.frontends: list[Sender[FrontendInput]] = [
            Sender(ctx, config.ipc(frontend_socket(i))) for i in range(config.api_servers)
        ]
        self.kv_events = kv_publisher(ctx, config, core) if core.kv_events is not None else None

    def send(self, out: EngineOutputs) -> None:
        for msg in out.runner:
            self.runner.send(msg)
        for plan in out.plans:
            self.runner.send(plan)
        for msg in out.detok:
            self.detok.send(msg)
        for fid, reply in out.frontend:
            self.frontends[fid].send(reply)
        if self.kv_events is not None:
            self.kv_events.publish(out.kv_events)

    def run(self) -> None:
        core, poller = self.core, zmq.Poller()
        poller.register(self.inbox.socket, zmq.POLLIN)
        poller.register(self.results.socket, zmq.POLLIN)
        result: StepResult | StepRefused | None = None
        beat_at = 0.0  # time.monotonic() of the last Heartbeat
        stats = StatsLine(core, core.config.stats_interval_s)
        while not core.shutdown and not stop_requested():
            now = time.monotonic()
            if now - beat_at >= HEARTBEAT_INTERVAL_S:
                beat_at = now
                beat = Heartbeat(core.config.replica, core.overdue_s(now), core.stall.usual_s)
                for frontend in self.frontends:
                    frontend.send(beat)
                stats.maybe_log(now)
            # 1. drain inputs without blocking
            for msg in self.inbox.drain():
                core.handle(msg)
            # 2. apply the result that came, plan ahead, send what that produced
            self.send(core.step(result))
            result = None
            # 3. wait for the oldest step's result, or for input while idle
            events = dict(poller.poll(IDLE_POLL_MS))
            if self.results.socket in events:
                # timeout 0: a stray frame was dropped, and nothing else may have come
                match self.results.recv(timeout_ms=0):
                    case StepResult() as result:
                        stats.num_tokens += len(result.token_ids)
                    case StepRefused() as result:  # its requests end with an error
                        pass
                    case AdapterRead() as read:
                        core.adapter_read(read)
                    case RunnerError(seq=seq, message=message) if core.is_inflight(seq):
                        raise RuntimeError(f"gpu_runner failed: {message}")
                    case RunnerReady() | RunnerError() as other:  # why: only at start, or stray
                        core.bad.report(
                            "unexpected_message", f"{type(other).__name__} from the runner"
                        )
        core.timeline.close()
        if self.kv_events is not None:
            self.kv_events.close()
        if isinstance(self.runner, Publisher):  # the ranks hear the stop from here
            self.runner.send(Shutdown())
            self.runner.close(linger_ms=500)


def kv_publisher(ctx: zmq.Context, config: EngineConfig, core: EngineCore) -> KvEventPublisher:
    """This replica's KV event publisher (--kv-events-endpoint), its port offset by the rank."""
    assert config.kv_events_endpoint is not None
    publisher = KvEventPublisher(
        ctx,
        config.kv_events_endpoint,
        replay_endpoint=config.kv_events_replay_endpoint,
        topic=config.kv_events_topic or "",
        rank=config.replica,
        max_queue=config.kv_events_queue,
        buffer=config.kv_events_buffer,
        dropped=core.metrics.kv_events_dropped,
    )
    log.info("KV events on %s (replay: %s)", publisher.endpoint, publisher.replay_endpoint)
    return publisher


def plan_sender(
    ctx: zmq.Context, config: EngineConfig
) -> Sender[RunnerInput] | Publisher[RunnerInput]:
    """Where plans go: the runner's socket, or one publisher every tensor-parallel rank reads."""
    if config.num_ranks > 1:
        return Publisher(ctx, *plan_endpoints(config))
    return Sender(ctx, config.engine_ipc(RUNNER_IN), shm=True)


def run_core(config: EngineConfig) -> None:
    """Process entry of the core: waits for the runner's capacity, then schedules forever."""
    ctx = zmq.Context()
    control = ControlReporter(ctx, config, "core")
    results: Receiver[RunnerOutput] = Receiver(ctx, config.engine_ipc(RUNNER_OUT), RunnerOutput)
    runner = plan_sender(ctx, config)
    try:
        ready = None
        while ready is None and not stop_requested():
            msg = results.recv(timeout_ms=IDLE_POLL_MS)
            if isinstance(msg, RunnerReady):
                ready = msg
        if ready is None:
            return
        if isinstance(runner, Publisher):  # why: a plan published before a rank joined is lost
            size = config.num_ranks
            if not runner.wait_subscribers(size, int(config.dist_timeout_s * 1000)):
                raise RuntimeError(f"{runner.num_subscribers} of {size} runner ranks joined")
        costs = (ready.step_tokens, ready.step_seconds)
        core = EngineCore(config, ready.num_kv_blocks, step_costs=costs)
        process = CoreProcess(core, ctx, results, runner)
        control.ready(num_kv_blocks=ready.num_kv_blocks)
        process.run()
    except Exception as e:  # reported, then the supervisor ends the engine
        control.fatal(f"{type(e).__name__}: {e}")
        time.sleep(0.2)
        raise
    finally:
        control.close()
        ctx.destroy(linger=0)
