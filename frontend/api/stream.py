"""One HTTP request's stream of engine deltas: its choices' engine requests, the inbox their
deltas wait in, each choice's counters, the writes of its SSE events and the metrics of it all.

A RequestStream is made per request and lives as long as its `deltas()` runs: that sends the
AddRequests, hands each choice's deltas to the handler and, however it ends, aborts what still
runs. With `write_to`, the engine client's listener writes the usual SSE event (text only, of an
opened choice that goes on) itself while the handler waits (`write_now`, through
frontend/http/transport.py's chunk writer), and the handler writes the others (`write`); each counter
below is kept once, by whichever of the two handled the delta. A step's usual deltas wake no
handler: waking one per stream per step is what the listener's write saves (bench/RESULTS.md,
"SSE: the listener writes the usual event").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from typing import Protocol

from gapless.common.messages import AddRequest, SamplingParams, TextDelta
from gapless.frontend.api.replies import CompletionTokensDetails, PromptTokensDetails, Usage
from gapless.frontend.engine.client import DEAD, EngineClient, EngineDeadError, StreamCut
from gapless.frontend.engine.inbox import IDLE as _IDLE_MARK
from gapless.frontend.engine.inbox import Inbox, coalesced, joined
from gapless.frontend.engine.queue_view import Ticket
from gapless.frontend.http import metrics
from gapless.frontend.http.asgi import RequestStats, Responder

log = logging.getLogger("gapless.frontend")

IDLE = (-1, None, 0.0)  # what deltas() yields after keepalive_s without a delta


@dataclass
class Job:
    """What the engine is asked for one HTTP request: one engine request per choice."""

    endpoint: str  # "completions" or "chat", for metrics
    request_id: str
    prompt_ids: list[list[int]]  # one per choice (a batch of prompts gives choices n apiece)
    params: list[SamplingParams]  # one per choice
    tenant: str
    priority: int
    arrival_time: float  # time.time()
    ticket: Ticket  # its place in the admission count, for len(params) choices
    label: str = ""  # the X-Request-Id, carried to the engine for its logs
    stats: RequestStats = field(default_factory=RequestStats)  # for the access line
    cache_salt: str = ""  # its prefix-cache scope (tenants.cache_scope_of)
    num_prompt_tokens: int = 0  # usage: each prompt counted once, however many choices
    # one per choice: its prompt's prefix-cache block names (prelude.prompt_block_hashes)
    block_hashes: list[list[bytes]] = field(default_factory=list)
    prediction: list[int] = field(default_factory=list)  # `prediction`'s ids, every choice's
    lora: str = ""  # the LoRA adapter it runs with; "": the served model

    def __post_init__(self) -> None:
        assert len(self.prompt_ids) == len(self.params), "one prompt per choice"
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.prompt_ids[0])
        if not self.block_hashes:
            self.block_hashes = [[]] * len(self.params)


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


class RequestStream:
    """A request's choices (engine ids `{request_id}-{i}`) as one stream of deltas.

    `failure(delta)`, given, is the error a choice's last delta stands for (an engine fault,
    a queue timeout), raised in its place; such a delta counts no output."""

    __slots__ = (
        "job",
        "ids",
        "outputs",
        "output_ids",
        "cached",
        "last",
        "opened",
        "ended",
        "started",
        "reason",
        "_engine",
        "_failure",
        "_observer",
        "_index",
        "_num_running",
        "_inbox",
        "_fmt",
        "_out",
        "_keepalive_s",
        "_direct_on",
    )

    def __init__(
        self,
        engine: EngineClient,
        job: Job,
        failure: Callable[[TextDelta], Exception | None] | None = None,
    ) -> None:
        n = len(job.params)
        self.job = job
        self.ids = [f"{job.request_id}-{i}" for i in range(n)]
        # per choice
        self.outputs = [0] * n  # output tokens so far
        # with a prediction: each choice's output ids, for the usage's prediction counts
        self.output_ids: list[list[int]] | None = [[] for _ in range(n)] if job.prediction else None
        self.cached = [0] * n  # prompt tokens the prefix cache held, from its last delta
        self.last = [0.0] * n  # perf_counter of its previous delta with tokens
        self.opened = [False] * n  # the handler began it: its opening chunk went (`write`)
        self.ended = [False] * n  # its last delta came
        self.started = False  # a token came: the time to first token is observed
        self.reason: str | None = None  # the latest finish_reason of any choice
        self._engine = engine
        self._failure = failure
        self._observer = metrics.observer
        self._index = {rid: i for i, rid in enumerate(self.ids)}
        self._num_running = n
        self._inbox: Inbox | None = None  # while deltas() runs
        self._fmt: ChunkFormat | None = None
        self._out: Responder | None = None
        self._keepalive_s = 0.0
        self._direct_on = False  # the listener may write events (write_now)

    def write_to(self, fmt: ChunkFormat, out: Responder, keepalive_s: float = 0.0) -> None:
        """Makes this an SSE stream (call before `deltas()`): the listener writes the usual
        event itself while the handler waits, and with keepalive_s > 0 the handler is woken
        (IDLE) after each keepalive_s without a delta."""
        self._fmt, self._out, self._keepalive_s = fmt, out, keepalive_s
        self._direct_on = True

    async def deltas(self) -> AsyncIterator[tuple[int, TextDelta, float]]:
        """(choice index, delta, perf_counter when it reached the frontend) until every
        choice's last delta (the one with a finish_reason); deltas of a choice that waited
        come joined as one. With keepalive_s, IDLE after each keepalive_s without one.

        Raises EngineDeadError if the engine is or becomes dead (after the deltas that came
        before), StreamCut if this frontend ends the request (EngineClient.cut_all). Leaving
        early (break, aclose, cancellation) aborts the choices still running."""
        job = self.job
        self._observer.arrived(job.endpoint, job.num_prompt_tokens)
        try:
            inbox = self._open()
            while self._num_running:
                items, marks = await inbox.take()
                if len(items) == 1:  # the usual step: one delta
                    delta, received = items[0]
                    yield self._took(delta), delta, received
                elif items:  # the handler fell behind: it takes all that waited
                    for delta, received in self._joined(items):
                        yield self._took(delta), delta, received
                for mark in marks:
                    if mark is DEAD:
                        raise EngineDeadError(self._engine.dead_reason)
                    if isinstance(mark, StreamCut):
                        raise mark
                if not items and _IDLE_MARK in marks:
                    yield IDLE  # type: ignore[misc]
        finally:
            self._close()

    def _open(self) -> Inbox:
        job, engine = self.job, self._engine
        assert job.ticket.num_queued == len(self.ids), "a ticket for another number of choices"
        loop = asyncio.get_running_loop()
        inbox = self._inbox = Inbox(loop, self._keepalive_s, job.label or job.request_id)
        if self._direct_on:
            inbox.direct = self._direct
        requests = [
            AddRequest(
                rid,
                engine.frontend_id,
                prompt,
                params,
                job.arrival_time,
                job.tenant,
                job.priority,
                label=job.label,
                cache_salt=job.cache_salt,
                block_hashes=hashes,
                prediction=job.prediction,
                lora=job.lora,
            )
            for rid, prompt, params, hashes in zip(
                self.ids, job.prompt_ids, job.params, job.block_hashes, strict=True
            )
        ]
        engine.add(requests, inbox, job.ticket)
        return inbox

    def _close(self) -> None:
        job = self.job
        inbox = self._inbox
        if inbox is not None:
            self._inbox = None
            inbox.close()
            running = [rid for rid, ended in zip(self.ids, self.ended, strict=True) if not ended]
            self._engine.remove(self.ids, running)
            job.ticket.release()
        num_output = sum(self.outputs)
        job.stats.prompt_tokens = job.num_prompt_tokens
        job.stats.completion_tokens = num_output
        job.stats.finish_reason = self.reason
        e2e_s = time.time() - job.arrival_time
        self._observer.finished(job.endpoint, e2e_s, num_output, self.reason)

    def _joined(self, items: list[tuple[TextDelta, float]]) -> list[tuple[TextDelta, float]]:
        if len(self.ids) == 1:
            return [(joined([d for d, _ in items]), items[0][1])]
        return coalesced(items)

    def _took(self, delta: TextDelta) -> int:
        """Counts a delta the handler gets; its choice's index."""
        index = self._index[delta.request_id]
        if delta.token_ids:
            now = time.perf_counter()
            if not self.started:
                self.started = True
                job = self.job
                job.stats.ttft_s = time.time() - job.arrival_time
                self._observer.first_token(job.endpoint, job.stats.ttft_s)
            elif self.last[index]:
                self._observer.delta(now - self.last[index], len(delta.token_ids))
            self.last[index] = now
        if delta.finish_reason is not None:
            if not self.ended[index]:
                self.ended[index] = True
                self._num_running -= 1
            if self._failure is not None and (error := self._failure(delta)) is not None:
                raise error
            self.cached[index] = delta.num_cached_tokens
        self.outputs[index] = delta.num_output_tokens
        if self.output_ids is not None:
            self.output_ids[index] += delta.token_ids
        self.reason = delta.finish_reason or self.reason
        return index

    def _direct(self, items: list[tuple[TextDelta, float]]) -> bool:
        """Inbox.direct: what waited for the handler, joined as `deltas()` would hand it over,
        to `write_now`; declined (for the handler) if it is a choice's last delta or holds
        several choices' deltas."""
        delta, received = items[0]
        if len(items) > 1:
            rid = delta.request_id
            if len(self.ids) > 1 and any(d.request_id != rid for d, _ in items):
                return False
            delta = joined([d for d, _ in items])
        if delta.finish_reason is not None:
            return False
        return self.write_now(self._index[delta.request_id], delta, received)

    def write_now(self, index: int, delta: TextDelta, received: float) -> bool:
        """The listener's write of a delta the handler has not seen: True if written at
        once, byte for byte as `write` would; False (nothing written) unless it is the usual
        chunk of a choice the handler opened after the first token, and the connection takes
        it without a wait."""
        if not self.started or not self.opened[index]:
            return False
        chunk = self._fmt.plain(index, delta)  # type: ignore[union-attr]
        if chunk is None or not self._out.event_now(chunk):  # type: ignore[union-attr]
            return False
        # written: nothing below may raise, or the handler would write it again (Inbox.flush)
        self.outputs[index] = delta.num_output_tokens
        if self.output_ids is not None:
            self.output_ids[index] += delta.token_ids
        now = time.perf_counter()
        previous = self.last[index]
        if delta.token_ids:
            self.last[index] = now
        try:
            self._observer.streamed(now - received)
            if delta.token_ids and previous:
                self._observer.delta(now - previous, len(delta.token_ids))
        except Exception:
            log.exception("observing a written delta failed")
        return True

    async def write(self, index: int, delta: TextDelta, received: float) -> None:
        """The handler's write of a delta `deltas()` handed over: the choice's opening
        chunk if it is its first, then the delta's chunk (if it makes one)."""
        fmt, out = self._fmt, self._out
        assert fmt is not None and out is not None, "write_to first"
        if not self.opened[index]:
            self.opened[index] = True
            opening = fmt.opening(index, delta)
            if opening is not None:
                await out.event(opening)
        chunk = fmt.delta(index, delta)
        if chunk is not None:
            await out.event(chunk)
        self._observer.streamed(time.perf_counter() - received)

    def last_chunks(self) -> list[bytes]:
        """The last chunk (finish_reason "abort") of every choice still running, after its
        opening chunk if it had none: how a stream cut here ends its choices."""
        fmt = self._fmt
        assert fmt is not None, "write_to first"
        job, chunks = self.job, []
        for index, rid in enumerate(self.ids):
            if self.ended[index]:
                continue
            num_prompt = len(job.prompt_ids[index])
            last = TextDelta(rid, "", [], num_prompt, self.outputs[index], "abort")
            if not self.opened[index] and (opening := fmt.opening(index, last)) is not None:
                chunks.append(opening)
            if (chunk := fmt.delta(index, last)) is not None:
                chunks.append(chunk)
        return chunks

    def usage(self) -> Usage:
        """Prompt tokens counted once per prompt, however many choices share it (as its
        tokens and its cached tokens are); every choice's output tokens."""
        job = self.job
        completion = sum(self.outputs)
        seen: set[int] = set()
        cached = 0
        for prompt, num in zip(job.prompt_ids, self.cached, strict=True):
            if id(prompt) not in seen:
                seen.add(id(prompt))
                cached += num
        prompt_tokens = job.num_prompt_tokens
        return Usage(
            prompt_tokens,
            completion,
            prompt_tokens + completion,
            prompt_tokens_details=PromptTokensDetails(cached),
            completion_tokens_details=self._completion_details(),
        )

    def _completion_details(self) -> CompletionTokensDetails:
        """With a prediction, per choice: its tokens found in the output, in order (accepted)
        and the rest (rejected), summed over the choices."""
        if self.output_ids is None:
            return CompletionTokensDetails()
        pred, accepted = self.job.prediction, 0
        for ids in self.output_ids:
            blocks = SequenceMatcher(None, pred, ids, autojunk=False).get_matching_blocks()
            accepted += sum(b.size for b in blocks)
        rejected = len(pred) * len(self.output_ids) - accepted
        return CompletionTokensDetails(
            accepted_prediction_tokens=accepted, rejected_prediction_tokens=rejected
        )

    def tokens_waiting(self) -> int:
        """Tokens of this stream's deltas that wait for its handler."""
        inbox = self._inbox
        return 0 if inbox is None else sum(len(d.token_ids) for d, _ in inbox.waiting())
