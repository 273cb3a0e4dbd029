"""Running one validated request on the engine: collected whole, or streamed as SSE chunks.

Both endpoints share this; they differ only in how a choice or a chunk is shaped.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Iterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field
from functools import partial

from gapless.common.messages import TextDelta, TokenLogprob
from gapless.frontend.api.replies import Usage
from gapless.frontend.api.state import FrontendState
from gapless.frontend.api.stream import ChunkFormat, Job, RequestStream
from gapless.frontend.engine.admission import Admission
from gapless.frontend.engine.client import EngineDeadError, StreamCut
from gapless.frontend.http import metrics
from gapless.frontend.http.asgi import (
    STREAM_CONNECTION,
    ClientGone,
    HttpRequest,
    Responder,
    SlowReader,
    SlowReaderWatch,
    unless_disconnected,
)
from gapless.frontend.http.errors import ApiError, engine_unavailable

log = logging.getLogger("gapless.frontend")


@dataclass
class ChoiceResult:
    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = (
        None  # asked with echo: prompt tokens after the first
    )
    finish_reason: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)


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


async def collect(stream: RequestStream) -> list[ChoiceResult]:
    """Every choice's whole output."""
    choices = [ChoiceResult() for _ in stream.ids]
    async with aclosing(stream.deltas()) as deltas:
        async for index, delta, _ in deltas:
            choice = choices[index]
            choice.parts.append(delta.text)
            if delta.logprobs:
                choice.logprobs.extend(delta.logprobs)
            if delta.prompt_logprobs is not None:
                choice.prompt_logprobs = delta.prompt_logprobs
            choice.finish_reason = delta.finish_reason
    return choices


async def sse(
    stream: RequestStream,
    out: Responder,
    fmt: ChunkFormat,
    include_usage: bool,
    keepalive_s: float,
) -> None:
    """SSE chunks as deltas arrive, a usage chunk if asked, then [DONE]. The response starts
    with the first delta, so a failure before it still gets a proper HTTP status. While this
    waits for its next delta, the engine client's listener writes the usual chunk itself
    (RequestStream.write_now)."""
    stream.write_to(fmt, out, keepalive_s)
    try:
        async with aclosing(stream.deltas()) as deltas:
            async for index, delta, received in deltas:
                if delta is None:  # IDLE: nothing came for keepalive_s
                    await out.comment()
                    continue
                await stream.write(index, delta, received)
    except StreamCut as cut:
        # every choice still running gets its last chunk (finish_reason "abort"), then the
        # stream ends with the error event and [DONE]: at once, past flow control, once the
        # stream has begun (the server is going away; its client may not be reading)
        stream.job.stats.finish_reason = "abort"
        chunks = stream.last_chunks()
        error = cut_error(cut)
        if out.end_now(error, chunks):
            return
        for chunk in chunks:
            await out.event(chunk)
        raise error from None
    if include_usage:
        await out.event(fmt.usage(stream.usage()))
    await out.done()


def _watch(
    state: FrontendState, stream: RequestStream, req: HttpRequest, out: Responder
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
        stream.tokens_waiting,
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
    writer: Callable[[RequestStream, Responder], Awaitable[None]] | None = None,
    cut: Callable[[ApiError], bytes] | None = None,
) -> None:
    """Streams or answers whole; a client that disconnects first aborts the engine requests,
    and so does one that stops reading its stream (SlowReaderWatch), whose stream then ends
    with an error event and [DONE], or with `cut`'s frames for the error where given.
    `writer`, given, writes the stream in place of `sse` (its own events and ending); `build`
    may return an awaitable of the body."""
    stream = RequestStream(state.engine, job, partial(failure, admission=state.admission))
    try:
        with engine_errors(job):
            if streaming:
                keepalive_s = state.config.sse_keepalive_s
                writing = (
                    sse(stream, out, fmt, include_usage, keepalive_s)
                    if writer is None
                    else writer(stream, out)
                )
                await unless_disconnected(req.receive, writing, _watch(state, stream, req, out))
                return
            choices = await unless_disconnected(req.receive, collect(stream))
    except SlowReader as slow:
        # the engine requests were aborted as the stream's work ended
        log.warning("request %s aborted, its client is not reading: %s", job.request_id, slow)
        metrics.observer.slow_client(slow.reason)
        job.stats.finish_reason = "abort"
        if cut is None:
            out.end_now(slow.error())
        else:
            out.cut_now(cut(slow.error()))
        raise ClientGone from None
    body = build(choices, stream.usage())
    if inspect.isawaitable(body):
        body = await body
    await out.json(200, body)


@contextmanager
def engine_errors(job: Job) -> Iterator[None]:
    """How a request's engine work ends for its client: a cut stream as its error, a dead
    engine as 503, a client that left counted as an abort (and passed on)."""
    try:
        yield
    except StreamCut as cut:
        raise cut_error(cut) from None
    except EngineDeadError as exc:
        raise engine_unavailable(str(exc)) from None
    except ClientGone:
        metrics.observer.aborted(job.endpoint)
        raise
