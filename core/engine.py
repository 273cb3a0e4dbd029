"""The engine core in-process: request state, the scheduler and the pipeline, with no sockets.

`handle(msg)` takes what frontends and the detokenizer send; `step(result)` applies a step's
result (if one came), plans up to `depth` steps ahead (1 without overlap, 2, or 3 while the
device's steps are short) and returns everything to send, and to whom. core/process.py owns
the sockets and moves messages in and out; tests drive this class directly with an in-process
runner.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from gapless.common.bad_messages import BadMessages
from gapless.common.checks import request_problem
from gapless.common.config import EngineConfig
from gapless.common.kv_events import Event, KvEventLog
from gapless.common.messages import (
    QUEUE_STATE_INTERVAL_S,
    Abort,
    AdapterRead,
    AddRequest,
    CoreInput,
    DetokInput,
    DetokNew,
    EngineStats,
    FrontendInput,
    GetStats,
    GetTimeline,
    LoadLora,
    PrefixCacheReset,
    QueueState,
    ResetPrefixCache,
    RunnerInput,
    SamplingParams,
    Shutdown,
    StepPlan,
    StepRefused,
    StepResult,
    StreamEnded,
    Timeline,
    TokenBatch,
    UnloadLora,
)
from gapless.core.lora_book import AdapterBook
from gapless.core.lora_metrics import LoraMetrics
from gapless.core.metrics import CoreMetrics
from gapless.core.policy import make_policy
from gapless.core.request import Request
from gapless.core.scheduler import ScheduledStep, Scheduler, StepOutput
from gapless.core.stall import StallWatch
from gapless.core.timeline import DeviceTimeline

log = logging.getLogger("gapless.core")

DRAIN_WINDOW_S = 10.0  # QueueState's drain rate is over this long
PROMPT_TAIL = 4  # prompt ids the detokenizer decodes in front of the first output token
# end reasons as clients and metrics name them
CLIENT_REASON = {"stop_token": "stop", "queue_timeout": "error"}


@dataclass
class EngineOutputs:
    """What one call of `step` leaves to send, in order within each destination."""

    plans: list[StepPlan] = field(default_factory=list)  # to the runner
    runner: list[RunnerInput] = field(default_factory=list)  # to the runner, before the plans
    detok: list[DetokInput] = field(default_factory=list)  # to the detokenizer
    frontend: list[tuple[int, FrontendInput]] = field(default_factory=list)  # (frontend id, msg)
    kv_events: list[Event] = field(default_factory=list)  # to routers (--kv-events-endpoint)


# weight of the newest step in the moving average of device step time (about the last 16)
STEP_AVERAGE_WEIGHT = 1 / 16


class EngineCore:
    """Plans up to `depth` steps ahead of the results; depth 2 overlaps the host's work on
    step n's ids with the device running step n+1.

    Depth 3, while the device's steps are shorter than `deep_plan_ms`: with two in flight the
    host's whole round trip (step n's ids published, applied, step n+2 planned, sent and
    prepared) must fit in one step, and on a busy host with short steps it does not, so the
    device waits (bench/RESULTS.md, "host floor: three steps ahead"). What depth 3 costs: a
    request that arrives waits one step more for its first, and one more row of a finished
    request is computed and dropped, which is little while steps are short; at longer steps
    (h100-llama3-8b, the cpu device) depth stays 2.
    """

    def __init__(
        self,
        config: EngineConfig,
        num_kv_blocks: int,
        metrics: CoreMetrics | None = None,
        kv_events: bool | None = None,  # None: as --kv-events-endpoint says
        step_costs: tuple[list[int], list[float]] | None = None,  # RunnerReady's step table
    ) -> None:
        self.config = config
        self._step_s = float("inf")  # moving average of device step time; none seen yet
        if kv_events is None:
            kv_events = config.kv_events_endpoint is not None
        self.kv_events = KvEventLog(config.block_size) if kv_events else None
        if self.kv_events is not None:  # why: a router's model of this cache starts empty
            self.kv_events.cleared()
        self.scheduler = Scheduler(
            num_blocks=num_kv_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.model.max_model_len,
            eos_token_ids=config.model.eos_token_ids,
            policy=make_policy(
                config.scheduling_policy,
                weights=config.tenant_weights,
                output_weight=config.fair_output_weight,
                aging_s=config.priority_aging_s,
            ),
            prefix_caching=config.prefix_caching,
            model_salt=config.model.path,
            window=config.model.kv_window,
            kv_events=self.kv_events,
            speculative=config.speculative,
            num_speculative_tokens=config.num_speculative_tokens,
            step_costs=step_costs,
            max_loras=config.max_loras if config.enable_lora else 0,
            lora_ready=tuple(config.lora_modules),
        )
        seats = self.scheduler.lora
        self.adapters = AdapterBook(config, seats) if seats is not None else None
        self.inflight: deque[ScheduledStep] = deque()
        self.stall = StallWatch(config.stall_timeout_s)
        self.timeline = DeviceTimeline(config)
        self.metrics = metrics or CoreMetrics(
            known_tenants=tuple(config.tenants), replica=config.replica
        )
        self.metrics.cache_config(config.block_size, self.scheduler.blocks.num_usable)
        self.lora_metrics = None
        if seats is not None:
            m = self.metrics
            self.lora_metrics = LoraMetrics(m.registry, config.max_loras, m.tenant_label)
        self.shutdown = False
        self._out = EngineOutputs()
        self._ended: list[tuple[str, str, str]] = []  # (request id, end reason, error) to send
        self._queue_checked_at = -1.0  # time.monotonic() the queue was last looked at
        self._queue_state: QueueState | None = None
        self._freed: deque[tuple[float, int]] = deque()  # (monotonic, seats freed), last 10 s
        self.bad = BadMessages("core", log)

    @property
    def depth(self) -> int:
        """How many steps may be in flight now."""
        if not self.config.overlap:
            return 1
        return 3 if self._step_s * 1e3 < self.config.deep_plan_ms else 2

    @property
    def has_work(self) -> bool:
        return bool(self.inflight) or self.scheduler.has_work

    def overdue_s(self, now: float) -> float:
        """How long the oldest step's result has been owed, once past the stall bound (0.0
        while the runner keeps up); the first call past the bound logs and counts it."""
        stalls = self.stall.stalls
        overdue = self.stall.overdue_s(now)
        if self.stall.stalls > stalls:
            self.metrics.stalls.inc()
            step = self.inflight[0].plan.seq if self.inflight else -1
            log.warning(
                "the runner has owed step %d's result for %.1f s (the slowest of the recent "
                "steps took %.3f s): stalled",
                step, overdue, self.stall.usual_s,
            )  # fmt: skip
        return overdue

    def _result_came(self) -> None:
        """The oldest step in flight was just taken off: the runner answered."""
        lasted = self.stall.result(time.monotonic(), more=bool(self.inflight))
        if lasted:
            log.warning("the runner answered again after %.1f s", lasted)

    def is_inflight(self, seq: int) -> bool:
        """Whether step seq was planned and its result has not been applied."""
        return (
            bool(self.inflight) and self.inflight[0].plan.seq <= seq <= self.inflight[-1].plan.seq
        )

    # 1. inputs ------------------------------------------------------------------------------

    def handle(self, msg: CoreInput) -> None:
        """One message from a frontend or the detokenizer. Ids that already ended (an Abort
        after the last token) are ignored; what no frontend could have sent is dropped."""
        match msg:
            case AddRequest():
                self.add_request(msg)
            case Abort(request_ids=ids):
                self.end_requests(ids, "abort")
            case StreamEnded(request_ids=ids, reason=reason):
                self.end_requests(ids, reason, tell_detokenizer=False)
            case (
                GetStats(frontend_id=fid)
                | GetTimeline(frontend_id=fid)
                | ResetPrefixCache(frontend_id=fid)
                | LoadLora(frontend_id=fid)
                | UnloadLora(frontend_id=fid)
            ) if not self._known(fid):
                self.bad.report("unknown_frontend", f"{type(msg).__name__} for frontend {fid}")
            case GetStats(frontend_id=fid, token=token):
                self._out.frontend.append((fid, self.stats(token)))
            case GetTimeline(frontend_id=fid, token=token, last=last):
                tl = self.timeline
                steps, summary = tl.last(last), tl.summary()
                reply = Timeline(token, tl.device, tl.overlap, steps, summary)
                self._out.frontend.append((fid, reply))
            case ResetPrefixCache(frontend_id=fid, token=token):
                self._out.frontend.append((fid, PrefixCacheReset(token, self.reset_prefix_cache())))
            case LoadLora() | UnloadLora() if self.adapters is None:
                self.bad.report("no_adapters", f"{type(msg).__name__} without --enable-lora")
            case LoadLora():
                self.adapters.load(msg)
            case UnloadLora(name=name):
                if self.adapters.unload(msg):
                    self._end_waiting_of(name, "unloaded")
            case Shutdown():
                self.shutdown = True

    def adapter_read(self, msg: AdapterRead) -> None:
        """The runner read an adapter into host memory, or could not."""
        if self.adapters is None:
            self.bad.report("no_adapters", "AdapterRead without --enable-lora")
            return
        for name in self.adapters.read(msg):
            self._end_waiting_of(name, f"could not be read again: {msg.error}")

    def _end_waiting_of(self, name: str, why: str) -> None:
        """End the requests of adapter name that wait for a seat; running ones finish."""
        waiting = [r for r in self.scheduler.waiting_requests() if r.lora == name]
        for req in waiting:
            self._end(req, "error", f"the LoRA adapter {name!r} {why}")

    def _known(self, frontend_id: int) -> bool:
        return 0 <= frontend_id < self.config.api_servers

    def add_request(self, msg: AddRequest) -> None:
        """Queue a request, or end it with an error if it could never run or breaks the
        AddRequest contract (common/checks.py). One no frontend could be told of (an unknown
        frontend id, an id that is live already) is dropped."""
        rid = msg.request_id
        if not self._known(msg.frontend_id):
            self.bad.report("unknown_frontend", f"request {rid!r} for frontend {msg.frontend_id}")
            return
        if rid in self.scheduler.requests:
            self.bad.report("duplicate_request_id", f"request {rid!r} is live already")
            return
        problem = request_problem(msg, self.config)
        if problem is not None:
            reason, why = problem
            self.bad.report(reason, f"request {rid!r} ended with an error: {why}")
            self._refuse(msg, f"impossible request: {why}")
            return
        now = time.perf_counter()
        self.timeline.work_arrived(now)
        req = self.scheduler.add_request(msg)
        self._out.detok.append(
            DetokNew(
                request_id=msg.request_id,
                frontend_id=msg.frontend_id,
                params=msg.params,
                prompt_tail=msg.prompt_token_ids[-PROMPT_TAIL:],
            )
        )
        if msg.label and log.isEnabledFor(logging.DEBUG):
            log.debug("request %s added: x-request-id %s, %d prompt tokens",
                      msg.request_id, msg.label, len(msg.prompt_token_ids))  # fmt: skip
        why = self.scheduler.fits_ever(req)
        if why is not None:
            log.info("request %s (x-request-id %s) refused: %s", msg.request_id, msg.label, why)
            self._end(req, "error", why)
        else:
            self.metrics.request_added(msg.request_id, req.num_prompt, now)

    def _refuse(self, msg: AddRequest, why: str) -> None:
        """End a request the scheduler never saw: its frontend gets one error delta."""
        self._out.detok.append(
            DetokNew(msg.request_id, msg.frontend_id, SamplingParams(max_tokens=1), prompt_tail=[])
        )
        self._ended.append((msg.request_id, "error", why))
        self.metrics.request_ended(msg.request_id, "error")

    def end_requests(self, ids: list[str], reason: str, tell_detokenizer: bool = True) -> None:
        """End requests from outside a step (client gone, stream ended by the detokenizer);
        ids that already ended are ignored."""
        for rid in ids:
            req = self.scheduler.requests.get(rid)
            if req is not None:
                self._end(req, reason, tell_detokenizer=tell_detokenizer)

    def _end(self, req: Request, reason: str, error: str = "", tell_detokenizer=True) -> None:
        if self.scheduler.finish(req, reason):
            self.metrics.request_ended(req.request_id, CLIENT_REASON.get(reason, reason))
            if tell_detokenizer:
                self._ended.append((req.request_id, reason, error))

    def stats(self, token: int) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            token=token,
            num_running=len(s.running),
            num_waiting=s.num_waiting,
            num_free_blocks=s.blocks.num_free,
            num_total_blocks=s.blocks.num_usable,
            num_cached_blocks=s.blocks.num_cached,
            num_cached_free_blocks=s.blocks.num_cached_free,
            prefix_queried_tokens=s.num_queried_tokens,
            prefix_hit_tokens=s.num_hit_tokens,
            prefix_evictions=s.blocks.num_evictions,
        )

    # 2. a step ------------------------------------------------------------------------------

    def step(self, result: StepResult | StepRefused | None = None) -> EngineOutputs:
        """Apply the oldest step's result if one came, plan ahead, and return what to send."""
        out = None if result is None else self._take(result)
        now = time.monotonic()
        if self.config.max_queue_wait_s is not None:
            self._expire_waiting(now, self.config.max_queue_wait_s)
        if out is not None or self._ended:
            self._out.detok.append(self._token_batch(out))
        self._plan_ahead()
        if self.adapters is not None:
            self._take_adapters()
        self.metrics.observe_queues(self.scheduler)
        if now - self._queue_checked_at >= QUEUE_STATE_INTERVAL_S:
            self._send_queue_state(now)
        if self.kv_events is not None:
            self._out.kv_events = self.kv_events.take()
        outputs, self._out = self._out, EngineOutputs()
        return outputs

    def _take_adapters(self) -> None:
        """Reads for the adapters requests wait for; what the adapters' changes send."""
        book = self.adapters
        assert book is not None
        if book.seats.held:
            for name in book.want():
                self._end_waiting_of(name, "is not loaded")
        book.let_go()  # what the last read kept past --max-cpu-loras, once no request needs it
        if book.runner:
            self._out.runner += book.runner
            book.runner = []
        if book.frontend:
            self._out.frontend += book.frontend
            book.frontend = []

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (AllBlocksCleared to routers); False while any request
        holds KV blocks, as vLLM refuses then too."""
        return self.scheduler.blocks.reset()

    def _expire_waiting(self, now: float, limit_s: float) -> None:
        """End requests that have waited longer than limit_s for their first step."""
        expired = []
        for req in self.scheduler.policy:  # arrival order: the unstarted ones oldest first
            if req.started:  # preempted: it has had its first step
                continue
            if now - req.queued_at <= limit_s:
                break
            expired.append(req)
        seats = self.scheduler.lora
        if seats is not None and seats.held:  # waiting aside for their adapter: as long a limit
            expired += [r for r in seats.waiting() if not r.started and now - r.queued_at > limit_s]
        for req in expired:
            waited = now - req.queued_at
            why = f"waited {waited:.1f} s for a seat, longer than --max-queue-wait {limit_s:g} s"
            self._end(req, "queue_timeout", why)

    def _send_queue_state(self, now: float) -> None:
        """Tell every frontend what waits, per frontend and tenant, if that changed; and the
        per-tenant series of /metrics. At most every QUEUE_STATE_INTERVAL_S: it walks the queue."""
        self._queue_checked_at = now
        n = self.config.api_servers
        waiting, tokens = [0] * n, [0] * n
        tenants: list[dict[str, int]] = [{} for _ in range(n)]
        priorities: dict[int, int] = {}
        for req in self.scheduler.waiting_requests():
            f = req.frontend_id
            waiting[f] += 1
            tokens[f] += req.num_prompt
            tenants[f][req.tenant] = tenants[f].get(req.tenant, 0) + 1
            priorities[req.priority] = priorities.get(req.priority, 0) + 1
        freed = self._freed
        while freed and freed[0][0] < now - DRAIN_WINDOW_S:
            freed.popleft()
        # why freed, not given: a fill of idle seats gives many and says nothing of the drain
        rate = sum(k for _, k in freed) / DRAIN_WINDOW_S
        self.metrics.observe_tenants(tenants, priorities, self.scheduler)
        if self.lora_metrics is not None:
            self.lora_metrics.observe(self.scheduler)
        last = self._queue_state
        if last is not None and (last.waiting, last.waiting_tokens) == (waiting, tokens):
            if last.tenant_waiting == tenants:
                return
        state = QueueState(waiting, tokens, tenants, rate, self.config.replica)
        self._queue_state = state
        self._out.frontend.extend((f, state) for f in range(n))

    def _plan_ahead(self) -> None:
        depth = self.depth
        while len(self.inflight) < depth:
            t0 = time.perf_counter()
            step = self.scheduler.schedule()
            if step is None:
                return
            step.plan_sent = time.perf_counter()
            step.schedule_s = step.plan_sent - t0
            if not self.inflight:
                self.stall.owed(time.monotonic())
            self._out.plans.append(step.plan)
            self.inflight.append(step)
            if step.plan.freed_slots:
                self._freed.append((time.monotonic(), len(step.plan.freed_slots)))
            self.metrics.step_planned(step, self.scheduler.running)

    def _take(self, result: StepResult | StepRefused) -> StepOutput | None:
        """Apply the result of the oldest step in flight; any other is dropped. One whose shape
        does not match that step's plan ends the step's requests with an error. Per step: a
        sequence number and a few lengths compared."""
        inflight = self.inflight
        if not inflight or result.seq != inflight[0].plan.seq:
            expected = inflight[0].plan.seq if inflight else "none in flight"
            self.bad.report(
                "unplanned_result", f"result of step {result.seq} ({expected}): dropped"
            )
            return None
        if isinstance(result, StepRefused):
            return self._fail_step(f"the runner refused step {result.seq}: {result.reason}")
        step, n = inflight[0], len(result.token_ids)
        lps, vecs = result.logprobs, result.embeddings
        rows = n
        if result.counts:  # a verify: counts[j] ids for row j, each at least one
            rows = len(result.counts) if sum(result.counts) == n else -1
            if min(result.counts) < 1 or step.drafts is None:
                rows = -1
        if (
            rows == len(step.sampled)
            and result.timing is not None
            and (not lps or len(lps) == n)
            and (not vecs or len(vecs) == rows)
        ):
            return self._apply(result)
        why = (
            f"the result of step {result.seq} has {n} ids, {len(lps)} logprobs and "
            f"{len(vecs)} embeddings for "
            f"{len(step.sampled)} sampled entries, timing {result.timing is not None}"
        )
        self.bad.report("result_shape", f"{why}; its requests ended with an error")
        return self._fail_step(f"impossible step result: {why}")

    def _fail_step(self, why: str) -> StepOutput:
        """End every request the oldest step samples or scores, then apply it with a filler
        result: their ids are dropped as any finished request's are."""
        step = self.inflight.popleft()
        self._result_came()
        for req in [*step.sampled, *step.scorers.values()]:
            self._end(req, "error", why)
        filler = StepResult(seq=step.plan.seq, token_ids=[0] * len(step.sampled))
        return self.scheduler.update_from_output(step, filler)

    def _apply(self, result: StepResult) -> StepOutput:
        t0 = time.perf_counter()
        step = self.inflight.popleft()
        self._result_came()
        if result.num_drafted:
            self.metrics.spec.step(step.sampled, result)
        out = self.scheduler.update_from_output(step, result)
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
            num_cached_tokens=step.num_cached_tokens,
            result=result,
            applied=done,
            apply_s=apply_s,
        )
        assert result.timing is not None  # record() asserted it
        busy = result.timing.device_end - result.timing.device_start
        if self._step_s == float("inf"):
            self._step_s = busy
        else:
            self._step_s += STEP_AVERAGE_WEIGHT * (busy - self._step_s)
        reasons = out.end_reasons
        if reasons.count("") < len(reasons):  # why: most steps end nothing; skip the Python loop
            reasons = [CLIENT_REASON.get(r, r) for r in reasons if r]
        self.metrics.step_applied(
            result.timing, apply_s, self.timeline, reasons, len(out.token_ids)
        )
        if not self.inflight and not self.scheduler.has_work:
            self.timeline.went_empty()
        return out

    def _token_batch(self, out: StepOutput | None) -> TokenBatch:
        """One step's tokens, then the requests that ended outside it (no token)."""
        if out is None:
            out = StepOutput()
        n = len(out.requests)
        batch = TokenBatch(
            # copies: requests that ended outside the step are appended below
            request_ids=[*out.request_ids]
            if out.request_ids is not None
            else [r.request_id for r in out.requests],
            counts=[1] * n if out.counts is None else out.counts,
            token_ids=out.token_ids,
            finish_reasons=out.end_reasons,
            num_prompt_tokens=[*out.num_prompt_tokens]
            if out.num_prompt_tokens is not None
            else [r.num_prompt for r in out.requests],
            logprobs=out.logprobs,
            prompt_logprobs=out.prompt_logprobs,
            embeddings=out.embeddings,
        )
        if any(out.end_reasons):  # why only then: the count is read from the last delta
            batch.num_cached_tokens = [r.num_cached_prompt for r in out.requests]
        if self._ended:
            batch.errors = [""] * n
            for rid, reason, error in self._ended:
                batch.request_ids.append(rid)
                batch.counts.append(0)
                batch.finish_reasons.append(reason)
                batch.num_prompt_tokens.append(0)
                batch.errors.append(error)
                if batch.num_cached_tokens:
                    batch.num_cached_tokens.append(0)
                if batch.prompt_logprobs:
                    batch.prompt_logprobs.append(None)
                if batch.embeddings:
                    batch.embeddings.append(b"")
            self._ended.clear()
        return batch
