"""Running one validated request on the engine: collected whole, or streamed as SSE chunks.

Both endpoints share this; they differ only in how a choice or a chunk is shaped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Protocol

from gapless.common.block_hash import chain_hashes, hash_root
from gapless.common.config import EngineConfig
from gapless.common.messages import SamplingParams, TextDelta, TokenLogprob
from gapless.frontend import metrics
from gapless.frontend.admission import Admission
from gapless.frontend.asgi import (
    STREAM_CONNECTION,
    ClientGone,
    HttpRequest,
    RequestStats,
    Responder,
    SlowReader,
    SlowReaderWatch,
    unless_disconnected,
)
from gapless.frontend.engine_client import EngineDeadError, StreamCut
from gapless.frontend.errors import ApiError, engine_unavailable
from gapless.frontend.queue_view import Ticket
from gapless.frontend.responses import CompletionTokensDetails, PromptTokensDetails, Usage
from gapless.frontend.state import FrontendState

log = logging.getLogger("gapless.frontend")


@dataclass
class Job:
    endpoint: str  # "completions" or "chat", for metrics
    request_id: str
    prompt_ids: list[list[int]]  # one per choice (a batch of prompts gives choices n apiece)
    params: list[SamplingParams]  # one per choice
    tenant: str
    priority: int
    arrival_time: float  # time.time()
    ticket: Ticket  # its place in the admission count
    label: str = ""  # the X-Request-Id, carried to the engine for its logs
    stats: RequestStats = field(default_factory=RequestStats)  # for the access line
    cache_salt: str = ""
    num_prompt_tokens: int = 0  # usage: each prompt counted once, however many choices

    def __post_init__(self) -> None:
        assert len(self.prompt_ids) == len(self.params), "one prompt per choice"
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.prompt_ids[0])


@dataclass
class ChoiceResult:
    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = (
        None  # asked with echo: prompt tokens after the first
    )
    finish_reason: str | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def text(self) -> str:
        return "".join(self.parts)


class ChunkFormat(Protocol):
    """Shapes one endpoint's SSE chunks as encoded JSON."""

    def opening(self, index: int, first: TextDelta) -> bytes | None: ...

    def delta(self, index: int, delta: TextDelta) -> bytes | None:
        """The chunk for this delta; None when there is nothing to send yet."""
        ...

    def plain(self, index: int, delta: TextDelta) -> bytes | None:
        """`delta`'s chunk if it is the usual one, text only and built from nothing but the
        delta's text (so it changes no state of the format); None otherwise."""
        ...

    def usage(self, usage: Usage) -> bytes: ...


def failure(delta: TextDelta, admission: Admission) -> ApiError | None:
    """The error a finishing delta stands for: an engine fault is not the client's doing, a
    queue timeout is the load's (429)."""
    if delta.finish_reason == "error":
        if delta.code == "queue_timeout":
            return admission.queue_timeout(delta.error or "it waited too long for a seat")
        return ApiError(
            500,
            f"the engine failed on this request: {delta.error or 'no detail'}",
            code="engine_error",
        )
    if delta.finish_reason == "abort":
        return ApiError(503, "the engine aborted this request", code="request_aborted")
    return None


def cut_error(cut: StreamCut) -> ApiError:
    return ApiError(503, str(cut), code="drain_timeout")


def prompt_block_hashes(config: EngineConfig, prompt_ids: list[int], scope: str) -> list[bytes]:
    """The prefix-cache names of the prompt's full blocks in its cache scope (the Job's
    cache_salt, from tenants.cache_scope_of), so the core's step loop does not spend its time
    hashing (~90 us per 1,024 tokens); none with caching off."""
    if not config.prefix_caching:
        return []
    return chain_hashes(hash_root(config.model.path, scope), prompt_ids, config.block_size)


def _choice_block_hashes(config: EngineConfig, job: Job) -> list[list[bytes]]:
    """Each choice's prompt block names; a prompt shared by several choices is hashed once."""
    named: dict[int, list[bytes]] = {}
    out = []
    for prompt in job.prompt_ids:
        if id(prompt) not in named:
            named[id(prompt)] = prompt_block_hashes(config, prompt, job.cache_salt)
        out.append(named[id(prompt)])
    return out


def usage_of(job: Job, num_output_tokens: list[int], num_cached_tokens: list[int]) -> Usage:
    """num_cached_tokens: each choice's prompt tokens found in the prefix cache; a prompt counts
    once, by its first choice, however many choices share it (as its tokens do)."""
    completion = sum(num_output_tokens)
    seen: set[int] = set()
    cached = 0
    for prompt, num in zip(job.prompt_ids, num_cached_tokens, strict=True):
        if id(prompt) not in seen:
            seen.add(id(prompt))
            cached += num
    prompt = job.num_prompt_tokens
    return Usage(
        prompt,
        completion,
        prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached),
        completion_tokens_details=CompletionTokensDetails(),
    )


async def _deltas(
    state: FrontendState,
    job: Job,
    keepalive_s: float = 0.0,
    direct: Callable[[int, TextDelta, float], bool] | None = None,
) -> AsyncIterator[tuple[int, TextDelta]]:
    """The engine's deltas for the job, with failures raised as ApiError and metrics observed
    (and, with keepalive_s, engine_client.IDLE when none came for that long). `direct` is
    generate_n's: what it takes after the first token is observed here too, not yielded."""
    observer = metrics.observer
    observer.arrived(job.endpoint, job.num_prompt_tokens)
    first = True
    outputs = [0] * len(job.params)
    last = [0.0] * len(job.params)  # perf_counter of each choice's previous delta
    reason = None

    def offered(index: int, delta: TextDelta, received: float) -> bool:
        if first or direct is None or not direct(index, delta, received):
            return False
        outputs[index] = delta.num_output_tokens
        if delta.token_ids:
            now = time.perf_counter()
            if last[index]:
                _written_anyway(observer.delta, now - last[index], len(delta.token_ids))
            last[index] = now
        return True

    stream = state.engine.generate_n(
        job.request_id,
        job.prompt_ids[0],
        job.params,
        choice_prompts=job.prompt_ids,
        tenant=job.tenant,
        priority=job.priority,
        arrival_time=job.arrival_time,
        ticket=job.ticket,
        keepalive_s=keepalive_s,
        label=job.label,
        cache_salt=job.cache_salt,
        choice_block_hashes=_choice_block_hashes(state.config, job),
        direct=None if direct is None else offered,
    )
    try:
        async with aclosing(stream):
            async for index, delta in stream:
                if index < 0:  # IDLE
                    yield index, delta
                    continue
                if delta.token_ids:
                    now = time.perf_counter()
                    if first:
                        first = False
                        job.stats.ttft_s = time.time() - job.arrival_time
                        observer.first_token(job.endpoint, job.stats.ttft_s)
                    elif last[index]:
                        observer.delta(now - last[index], len(delta.token_ids))
                    last[index] = now
                if delta.finish_reason is not None:
                    error = failure(delta, state.admission)
                    if error is not None:
                        raise error
                outputs[index] = delta.num_output_tokens
                reason = delta.finish_reason or reason
                yield index, delta
    except EngineDeadError as exc:
        raise engine_unavailable(str(exc)) from None
    finally:
        job.stats.prompt_tokens = job.num_prompt_tokens
        job.stats.completion_tokens = sum(outputs)
        job.stats.finish_reason = reason
        observer.finished(job.endpoint, time.time() - job.arrival_time, sum(outputs), reason)


def _written_anyway(observe: Callable[..., None], *args: float) -> None:
    """An observation of a delta already written by a stream's `direct`: if it fails, the
    delta must still count as written, or its handler would write it again (Inbox.flush)."""
    try:
        observe(*args)
    except Exception:
        log.exception("observing a written delta failed")


async def collect(state: FrontendState, job: Job) -> list[ChoiceResult]:
    """Every choice's whole output."""
    choices = [ChoiceResult() for _ in job.params]
    async with aclosing(_deltas(state, job)) as deltas:
        async for index, delta in deltas:
            choice = choices[index]
            choice.parts.append(delta.text)
            if delta.logprobs:
                choice.logprobs.extend(delta.logprobs)
            if delta.prompt_logprobs is not None:
                choice.prompt_logprobs = delta.prompt_logprobs
            choice.num_output_tokens = delta.num_output_tokens
            choice.finish_reason = delta.finish_reason
            if delta.finish_reason is not None:
                choice.num_cached_tokens = delta.num_cached_tokens
    return choices


async def stream(
    state: FrontendState, job: Job, out: Responder, fmt: ChunkFormat, include_usage: bool
) -> None:
    """SSE chunks as deltas arrive, a usage chunk if asked, then [DONE]. The response starts
    with the first delta, so a failure before it still gets a proper HTTP status.

    While this waits for its next delta, the engine client's listener writes the usual
    chunk (text only, of an opened choice that goes on) itself, if the connection takes it
    without a wait (`written_now`): at 1-2 ms steps and hundreds of streams, waking this
    handler for every step cost several times the socket write (docs/architecture.md,
    "Streaming at the host floor")."""
    opened = [False] * len(job.params)
    outputs = [0] * len(job.params)
    ended = [False] * len(job.params)
    cached = [0] * len(job.params)
    observer = metrics.observer
    engine = state.engine
    keepalive_s = state.config.sse_keepalive_s

    def written_now(index: int, delta: TextDelta, received: float) -> bool:
        if not opened[index]:
            return False
        chunk = fmt.plain(index, delta)
        if chunk is None or not out.event_now(chunk):
            return False
        outputs[index] = delta.num_output_tokens
        _written_anyway(observer.streamed, time.perf_counter() - received)
        return True

    try:
        async with aclosing(_deltas(state, job, keepalive_s, written_now)) as deltas:
            async for index, delta in deltas:
                if index < 0:  # nothing came for keepalive_s
                    await out.comment()
                    continue
                received = engine.last_received  # read before the first await below
                if not opened[index]:
                    opened[index] = True
                    opening = fmt.opening(index, delta)
                    if opening is not None:
                        await out.event(opening)
                outputs[index] = delta.num_output_tokens
                ended[index] = delta.finish_reason is not None
                if delta.finish_reason is not None:
                    cached[index] = delta.num_cached_tokens
                chunk = fmt.delta(index, delta)
                if chunk is not None:
                    await out.event(chunk)
                observer.streamed(time.perf_counter() - received)
    except StreamCut as cut:
        # every choice still running gets its last chunk (finish_reason "abort"), then the
        # stream ends with the error event and [DONE]: at once, past flow control, once the
        # stream has begun (the server is going away; its client may not be reading)
        job.stats.finish_reason = "abort"
        chunks = []
        for index, done in enumerate(ended):
            if done:
                continue
            rid = f"{job.request_id}-{index}"
            last = TextDelta(rid, "", [], len(job.prompt_ids[index]), outputs[index], "abort")
            if not opened[index] and (opening := fmt.opening(index, last)) is not None:
                chunks.append(opening)
            if (chunk := fmt.delta(index, last)) is not None:
                chunks.append(chunk)
        error = cut_error(cut)
        if out.end_now(error, chunks):
            return
        for chunk in chunks:
            await out.event(chunk)
        raise error from None
    if include_usage:
        await out.event(fmt.usage(usage_of(job, outputs, cached)))
    await out.done()


def _watch(
    state: FrontendState, job: Job, req: HttpRequest, out: Responder
) -> SlowReaderWatch | None:
    """A stream's slow-reader watch, its kernel send buffer bounded, where the server tells
    of its connection."""
    connection = (req.scope.get("extensions") or {}).get(STREAM_CONNECTION)
    if connection is None:
        return None
    connection.limit_send_buffer()
    out.connection = connection
    config = state.config
    return SlowReaderWatch(
        out,
        connection,
        config.stream_write_timeout_s,
        config.stream_buffer_events,
        lambda: state.engine.tokens_waiting(job.request_id),
    )


async def respond(
    state: FrontendState,
    job: Job,
    req: HttpRequest,
    out: Responder,
    *,
    streaming: bool,
    include_usage: bool,
    fmt: ChunkFormat,
    build: Callable[[list[ChoiceResult], Usage], object],
) -> None:
    """Streams or answers whole; a client that disconnects first aborts the engine requests,
    and so does one that stops reading its stream (SlowReaderWatch), whose stream then ends
    with an error event."""
    job.label, job.stats = req.request_id, req.stats
    try:
        if streaming:
            await unless_disconnected(
                req.receive,
                stream(state, job, out, fmt, include_usage),
                _watch(state, job, req, out),
            )
            return
        choices = await unless_disconnected(req.receive, collect(state, job))
    except SlowReader as slow:
        # the engine requests were aborted as the stream's work ended
        log.warning("request %s aborted, its client is not reading: %s", job.request_id, slow)
        metrics.observer.slow_client(slow.reason)
        job.stats.finish_reason = "abort"
        out.end_now(slow.error())
        raise ClientGone from None
    except StreamCut as cut:
        raise cut_error(cut) from None
    except ClientGone:
        metrics.observer.aborted(job.endpoint)
        raise
    usage = usage_of(
        job, [c.num_output_tokens for c in choices], [c.num_cached_tokens for c in choices]
    )
    await out.json(200, build(choices, usage))
