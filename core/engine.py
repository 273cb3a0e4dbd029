"""The core process: owns request state and the scheduler, and keeps the runner fed."""

from __future__ import annotations

import time
from collections import deque

import zmq

from gapless.core.common.channel import Receiver, Sender
from gapless.core.common.config import EngineConfig
from gapless.core.common.messages import (
    Abort,
    AddRequest,
    CoreInput,
    DetokInput,
    DetokNew,
    EngineStats,
    FrontendInput,
    GetStats,
    GetTimeline,
    RunnerError,
    RunnerInput,
    RunnerOutput,
    RunnerReady,
    Shutdown,
    StepResult,
    StopHit,
    TextDelta,
    TextDeltas,
    Timeline,
    TokenBatch,
)
from gapless.core.common.process import (
    CORE_IN,
    DETOK_IN,
    RUNNER_IN,
    RUNNER_OUT,
    ControlReporter,
    frontend_socket,
    stop_requested,
)
from gapless.core.metrics import CoreMetrics
from gapless.core.scheduler import ScheduledStep, Scheduler, StepOutput
from gapless.core.timeline import DeviceTimeline

PROMPT_TAIL = 4  # prompt ids the detokenizer decodes in front of the first output token


class EngineCore:
    """The busy loop: drain inputs, plan up to `depth` steps ahead, apply one result."""

    def __init__(self, config: EngineConfig, ctx: zmq.Context, num_kv_blocks: int) -> None:
        self.config = config
        self.depth = 2 if config.overlap else 1
        self.scheduler = Scheduler(
            num_blocks=num_kv_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.model.max_model_len,
            eos_token_ids=config.model.eos_token_ids,
        )
        self.inbox: Receiver[CoreInput] = Receiver(ctx, config.ipc(CORE_IN), CoreInput)
        self.results: Receiver[RunnerOutput] | None = None
        self.runner: Sender[RunnerInput] = Sender(ctx, config.ipc(RUNNER_IN), shm=True)
        self.detok: Sender[DetokInput] = Sender(ctx, config.ipc(DETOK_IN), shm=True)
        self.frontends: list[Sender[FrontendInput]] = [
            Sender(ctx, config.ipc(frontend_socket(i))) for i in range(config.api_servers)
        ]
        self.inflight: deque[ScheduledStep] = deque()
        self.timeline = DeviceTimeline(config)
        self.metrics = CoreMetrics()
        self._ended: list[tuple[str, str]] = []  # (request id, reason) to tell the detokenizer
        self._shutdown = False

    # 1. inputs ------------------------------------------------------------------------------

    def handle(self, msg: CoreInput) -> None:
        match msg:
            case AddRequest():
                self._add(msg)
            case Abort(request_ids=ids):
                for rid in ids:
                    req = self.scheduler.requests.get(rid)
                    if req is not None and self.scheduler.finish(req, "abort"):
                        self._ended.append((rid, "abort"))
                        self.metrics.request_ended(rid, "abort")
            case StopHit(request_id=rid):
                # the detokenizer already sent the final text; this entry lets it forget the request
                req = self.scheduler.requests.get(rid)
                if req is not None and self.scheduler.finish(req, "stop"):
                    self._ended.append((rid, "stop"))
                    self.metrics.request_ended(rid, "stop")
            case GetStats(frontend_id=fid, token=token):
                s = self.scheduler
                self.frontends[fid].send(
                    EngineStats(
                        token=token,
                        num_running=len(s.running),
                        num_waiting=len(s.waiting),
                        num_free_blocks=s.blocks.num_free,
                        num_total_blocks=s.blocks.num_usable,
                    )
                )
            case GetTimeline(frontend_id=fid, token=token, last=last):
                tl = self.timeline
                self.frontends[fid].send(
                    Timeline(
                        token=token,
                        device=tl.device,
                        overlap=tl.overlap,
                        steps=tl.last(last),
                        summary=tl.summary(),
                    )
                )
            case Shutdown():
                self._shutdown = True

    def _add(self, msg: AddRequest) -> None:
        now = time.perf_counter()
        self.timeline.work_arrived(now)
        req = self.scheduler.add_request(msg)
        why = self.scheduler.fits_ever(req)
        if why is not None:
            self.scheduler.finish(req, "error")
            self.metrics.request_ended(msg.request_id, "error")
            self.frontends[msg.frontend_id].send(
                TextDeltas(
                    deltas=[
                        TextDelta(
                            request_id=msg.request_id,
                            text="",
                            token_ids=[],
                            num_prompt_tokens=req.num_prompt,
                            num_output_tokens=0,
                            finish_reason="error",
                            error=why,
                        )
                    ]
                )
            )
            return
        self.metrics.request_added(msg.request_id, req.num_prompt, now)
        self.detok.send(
            DetokNew(
                request_id=msg.request_id,
                frontend_id=msg.frontend_id,
                params=msg.params,
                prompt_tail=msg.prompt_token_ids[-PROMPT_TAIL:],
            )
        )

    # 2. planning ----------------------------------------------------------------------------

    def plan_ahead(self) -> None:
        while len(self.inflight) < self.depth:
            t0 = time.perf_counter()
            step = self.scheduler.schedule()
            if step is None:
                return
            step.plan_sent = time.perf_counter()
            step.schedule_s = step.plan_sent - t0
            self.runner.send(step.plan)
            self.inflight.append(step)
            self.metrics.step_planned(step, self.scheduler.running)

    # 3. results -----------------------------------------------------------------------------

    def apply(self, result: StepResult) -> None:
        t0 = time.perf_counter()
        step = self.inflight.popleft()
        out = self.scheduler.update_from_output(step, result)
        self._send_tokens(out, result)
        done = time.perf_counter()
        apply_s = done - t0
        plan = step.plan
        self.timeline.record(
            seq=plan.seq,
            plan_sent=step.plan_sent,
            schedule_s=step.schedule_s,
            num_tokens=step.num_prefill_tokens + step.num_decode_tokens,
            num_seqs=len(plan.slots),
            num_prefill_tokens=step.num_prefill_tokens,
            result=result,
            applied=done,
            apply_s=apply_s,
        )
        assert result.timing is not None  # record() asserted it
        self.metrics.step_applied(
            result.timing, apply_s, self.timeline, out.finish_reasons, len(out.token_ids)
        )
        if not self.inflight and not self.scheduler.has_work:
            self.timeline.went_empty()

    def _send_tokens(self, out: StepOutput, result: StepResult | None) -> None:
        if not out.requests and not self._ended:
            return
        batch = TokenBatch(
            request_ids=[r.request_id for r in out.requests],
            counts=[1] * len(out.requests),
            token_ids=out.token_ids,
            finish_reasons=out.finish_reasons,
            num_prompt_tokens=[r.num_prompt for r in out.requests],
        )
        if out.logprob_rows and result is not None and result.logprobs:
            offsets = [0]
            for c in result.top_counts:
                offsets.append(offsets[-1] + c)
            for row in out.logprob_rows:
                batch.logprobs.append(result.logprobs[row])
                batch.top_counts.append(result.top_counts[row])
                batch.top_ids.extend(result.top_ids[offsets[row] : offsets[row + 1]])
                batch.top_logprobs.extend(result.top_logprobs[offsets[row] : offsets[row + 1]])
        for rid, reason in self._ended:
            batch.request_ids.append(rid)
            batch.counts.append(0)
            batch.finish_reasons.append(reason)
            batch.num_prompt_tokens.append(0)
        self._ended.clear()
        self.detok.send(batch)

    # the loop ---------------------------------------------------------------------------------

    def run(self, results: Receiver[RunnerOutput]) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox.socket, zmq.POLLIN)
        poller.register(results.socket, zmq.POLLIN)
        while not self._shutdown and not stop_requested():
            # 1. drain inputs without blocking
            for msg in self.inbox.drain():
                self.handle(msg)
            if self._ended and not self.inflight:
                self._send_tokens(StepOutput(), None)
            # 2. plan up to `depth` steps ahead of the results
            self.plan_ahead()
            self.metrics.observe_queues(self.scheduler)
            # 3. wait for the oldest step's result, or for input while idle
            events = dict(poller.poll(100))
            if results.socket in events:
                match results.recv():
                    case StepResult() as result:
                        self.apply(result)
                    case RunnerError(message=message):
                        raise RuntimeError(f"gpu_runner failed: {message}")
        self.timeline.close()


def run_core(config: EngineConfig) -> None:
    """Process entry of the core: waits for the runner's capacity, then schedules forever."""
    ctx = zmq.Context()
    control = ControlReporter(ctx, config, "core")
    results: Receiver[RunnerOutput] = Receiver(ctx, config.ipc(RUNNER_OUT), RunnerOutput)
    try:
        ready = None
        while ready is None and not stop_requested():
            msg = results.recv(timeout_ms=100)
            if isinstance(msg, RunnerReady):
                ready = msg
        if ready is None:
            return
        core = EngineCore(config, ctx, ready.num_kv_blocks)
        control.ready(num_kv_blocks=ready.num_kv_blocks)
        core.run(results)
    except Exception as e:  # reported, then the supervisor ends the engine
        control.fatal(f"{type(e).__name__}: {e}")
        time.sleep(0.2)
        raise
    finally:
        control.close()
        ctx.destroy(linger=0)
