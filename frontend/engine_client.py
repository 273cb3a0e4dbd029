"""The frontend's side of the engine: send AddRequest / Abort, fan TextDeltas out per request.

One listener task reads the frontend's return socket and hands each TextDelta to the inbox of
the request it belongs to; `generate` yields from that inbox and aborts on early exit.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable

import zmq
import zmq.asyncio

from gapless.common.channel import AsyncReceiver, Sender
from gapless.common.config import EngineConfig
from gapless.common.messages import (
    Abort,
    AddRequest,
    CoreInput,
    EngineDead,
    EngineStats,
    FrontendInput,
    GetStats,
    GetTimeline,
    Heartbeat,
    QueueState,
    SamplingParams,
    TextDelta,
    TextDeltas,
    Timeline,
)
from gapless.common.process import CORE_IN, frontend_socket
from gapless.frontend.inbox import IDLE as _IDLE
from gapless.frontend.inbox import Inbox
from gapless.frontend.queue_view import QueueView, Ticket

log = logging.getLogger("gapless.frontend")

_DEAD = object()  # inbox marker: the engine died while the request was in flight


def _joined(deltas: list[TextDelta]) -> TextDelta:
    """Deltas of one engine request, in order, as one (copied once, however many)."""
    first, last = deltas[0], deltas[-1]
    logprobs = None
    if any(d.logprobs is not None for d in deltas):
        logprobs = [lp for d in deltas if d.logprobs for lp in d.logprobs]
    prompt_logprobs = next(
        (d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None
    )
    return TextDelta(
        first.request_id,
        "".join([d.text for d in deltas]),
        [t for d in deltas for t in d.token_ids],
        last.num_prompt_tokens,
        last.num_output_tokens,
        last.finish_reason,
        logprobs,
        last.error,
        last.code,
        num_cached_tokens=last.num_cached_tokens,
        prompt_logprobs=prompt_logprobs,
    )


def _coalesced(items: list[tuple[TextDelta, float]]) -> list[tuple[TextDelta, float]]:
    """Queued (delta, received) items as one delta per engine request, in the order each
    request first appears, its own deltas joined in order; the received time is the first's,
    so the delivery latency counts from the oldest token.

    A consumer that keeps up takes one item at a time and this changes nothing; one that fell
    behind (a slow client, a busy event loop) sends one SSE event per choice for everything
    that waited instead of one per step, which is what lets it catch up."""
    groups: dict[str, list[tuple[TextDelta, float]]] = {}
    for item in items:
        group = groups.get(item[0].request_id)
        if group is None:
            groups[item[0].request_id] = [item]
        else:
            group.append(item)
    return [
        group[0] if len(group) == 1 else (_joined([d for d, _ in group]), group[0][1])
        for group in groups.values()
    ]


class EngineDeadError(Exception):
    """The engine is gone; every in-flight and later request fails with this."""


class StreamCut(Exception):
    """The frontend ended the request itself before the engine did (the drain ran out of
    time); the message says why. Its choices still running are aborted in the engine."""


IDLE = (-1, None)  # what generate_n yields after keepalive_s without a delta
# s: the longest the listener dispatches frames that waited before the streams write; bounds
# how long a stream goes without an event while its frontend is behind
BURST_S = 0.01


class EngineClient:
    """Request bookkeeping over a `send` callable; `dispatch` is fed every FrontendInput.

    `generate_n` is the contract the HTTP handlers (and test doubles) rely on.
    """

    def __init__(
        self, frontend_id: int, send: Callable[[CoreInput], None], max_pending: int = 1024
    ) -> None:
        self.frontend_id = frontend_id
        # deltas one request may have waiting for its handler before they are joined into one
        # per choice (its handler would join them all the same when it runs)
        self.max_pending = max_pending
        self.queue = QueueView(frontend_id)  # what waits for a seat, for admission control
        self.healthy = True
        self.dead_reason = ""
        self._send = send
        # engine id -> inbox of (delta, perf_counter when its TextDeltas arrived), _DEAD, IDLE
        # or a StreamCut
        self._queues: dict[str, Inbox] = {}
        self._counter = itertools.count()
        self._replies: dict[int, asyncio.Future] = {}  # token -> answer of the core
        self._held: list[Inbox] = []  # inboxes holding deltas until flush_held
        self._on_dead: list[Callable[[str], None]] = []
        # perf_counter when the delta generate_n yielded last reached this frontend; valid until
        # the consumer's next await
        self.last_received = 0.0
        self.last_heartbeat = time.monotonic()  # of the core; it was READY before we started

    def next_request_id(self) -> str:
        return f"{self.frontend_id}-{next(self._counter)}"

    def core_silent_s(self) -> float:
        """Seconds since the core's last heartbeat."""
        return time.monotonic() - self.last_heartbeat

    def on_dead(self, callback: Callable[[str], None]) -> None:
        self._on_dead.append(callback)

    def dispatch(self, msg: FrontendInput, flush: bool = True) -> None:
        """Hands what the engine sent to the requests it is for. A stream with a `direct`
        (generate_n) has its deltas held and, with `flush`, offered to it or its handler
        woken; without, they wait for a later dispatch's flush (`flush_held`), to go out as
        one event with what comes next (the listener has more frames waiting)."""
        match msg:
            case TextDeltas(deltas=deltas):
                queues, unstarted, held = self._queues, self.queue.unstarted, self._held
                received = time.perf_counter()
                for delta in deltas:
                    rid = delta.request_id
                    if unstarted and rid in unstarted:  # its first delta: no longer queued
                        unstarted.pop(rid).leave(started=bool(delta.token_ids))
                    inbox = queues.get(rid)
                    if inbox is None:  # the request was aborted here already
                        continue
                    # why not a cut: its handler is behind, which a busy event loop does to a
                    # client that reads as well as to one that does not (SlowReaderWatch
                    # tells them apart)
                    if len(inbox) >= self.max_pending:
                        inbox.compact(_coalesced)
                    if inbox.direct is None:
                        inbox.put_delta((delta, received), received)
                    elif inbox.hold((delta, received), received):
                        held.append(inbox)
                if flush:
                    self.flush_held()
            case QueueState():
                self.queue.update(msg)
            case Heartbeat():
                self.last_heartbeat = time.monotonic()
            case EngineDead(reason=reason):
                self._mark_dead(reason)
            case EngineStats(token=token) | Timeline(token=token):
                waiter = self._replies.pop(token, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(msg)

    def flush_held(self) -> None:
        """Every held delta to its stream's `direct` or handler (Inbox.flush)."""
        held, self._held = self._held, []
        for inbox in held:
            inbox.flush()

    def tokens_waiting(self, request_id: str) -> int:
        """Tokens of generate_n(request_id)'s choices that wait for its consumer."""
        inbox = self._queues.get(f"{request_id}-0")
        return 0 if inbox is None else sum(len(d.token_ids) for d, _ in inbox.waiting())

    def cut_all(self, reason: str) -> list[str]:
        """End every request in flight here with StreamCut(reason); returns their names (each
        one's label, its X-Request-Id, or else its request id)."""
        inboxes = {id(q): q for q in self._queues.values()}.values()
        for inbox in inboxes:
            inbox.put(StreamCut(reason))
        return [inbox.name for inbox in inboxes]

    def mark_dead(self, reason: str) -> None:
        """The engine is gone: every request in flight and every later one fails."""
        self._mark_dead(reason)

    def _mark_dead(self, reason: str) -> None:
        if not self.healthy:
            return
        self.healthy = False
        log.error("engine dead: %s", reason)
        # why: clients see this; a traceback in the reason stays in the log
        self.dead_reason = (
            reason.strip().splitlines()[0] if reason.strip() else "the engine stopped"
        )
        for inbox in {id(q): q for q in self._queues.values()}.values():
            inbox.put(_DEAD)
        for waiter in self._replies.values():
            if not waiter.done():
                waiter.set_exception(EngineDeadError(self.dead_reason))
        self._replies.clear()
        for callback in self._on_dead:
            callback(self.dead_reason)

    async def generate_n(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: list[SamplingParams],
        *,
        tenant: str = "",
        priority: int = 0,
        arrival_time: float | None = None,
        ticket: Ticket | None = None,
        choice_prompts: list[list[int]] | None = None,
        keepalive_s: float = 0.0,
        label: str = "",
        cache_salt: str = "",
        choice_block_hashes: list[list[bytes]] | None = None,
        direct: Callable[[int, TextDelta, float], bool] | None = None,
    ) -> AsyncIterator[tuple[int, TextDelta]]:
        """One engine request per params entry (ids `{request_id}-{i}`), merged as
        (choice index, delta) until every choice's last delta (one with a finish_reason).

        `ticket` is the request's place in `queue` from its admission decision, for
        len(params) choices (without one, a ticket is taken here); each choice leaves it when
        its first delta comes or the request ends. `choice_prompts`, one per params entry,
        gives each choice its own prompt (a batch of completion prompts).

        With `keepalive_s` > 0, yields IDLE (-1, None) after each keepalive_s without a delta.

        `direct(index, delta, received)` may handle a delta that does not end its choice in
        place of the consumer, called by the listener while the consumer waits here with
        every earlier delta handled (several that waited come joined, as they would be
        yielded); it returns True if it did (the delta is not yielded), False to have it
        yielded as usual (Inbox.flush).

        Raises EngineDeadError if the engine is or becomes dead, StreamCut if this frontend
        ends the request (cut_all). Leaving early (break, aclose, cancellation) aborts the
        choices still running.
        """
        if not self.healthy:
            raise EngineDeadError(self.dead_reason)
        ids = [f"{request_id}-{i}" for i in range(len(params))]
        index = {rid: i for i, rid in enumerate(ids)}
        running = set(ids)
        arrival = time.time() if arrival_time is None else arrival_time
        if ticket is None:
            ticket = self.queue.take(tenant, len(params))
            ticket.set_prompt(len(prompt_token_ids))
        assert ticket.num_queued == len(params), "a ticket for another number of choices"
        unstarted = self.queue.unstarted
        inbox = Inbox(asyncio.get_running_loop(), keepalive_s, label or request_id)
        one_choice = len(ids) == 1
        if direct is not None:

            def offered(items: list[tuple[TextDelta, float]]) -> bool:
                delta, received = items[0]
                if len(items) > 1:
                    rid = delta.request_id
                    if not one_choice and any(d.request_id != rid for d, _ in items):
                        return False  # deltas of several choices
                    delta = _joined([d for d, _ in items])
                if delta.finish_reason is not None:
                    return False
                return direct(index[delta.request_id], delta, received)

            inbox.direct = offered
        for rid in ids:
            self._queues[rid] = inbox
            unstarted[rid] = ticket
        try:
            prompts = choice_prompts or [prompt_token_ids] * len(params)
            hashes = choice_block_hashes or [[]] * len(params)
            for rid, prompt, p, named in zip(ids, prompts, params, hashes, strict=True):
                self._send(
                    AddRequest(
                        rid,
                        self.frontend_id,
                        prompt,
                        p,
                        arrival,
                        tenant,
                        priority,
                        label=label,
                        cache_salt=cache_salt,
                        block_hashes=named,
                    )
                )
            while running:
                # more than one delta: the consumer fell behind, it takes all that waited
                deltas, marks = await inbox.take()
                if len(deltas) == 1:  # the usual step: one delta
                    delta, self.last_received = deltas[0]
                    if delta.finish_reason is not None:
                        running.discard(delta.request_id)
                    yield index[delta.request_id], delta
                elif deltas:
                    joined = (
                        [(_joined([d for d, _ in deltas]), deltas[0][1])]
                        if one_choice
                        else _coalesced(deltas)
                    )
                    for delta, self.last_received in joined:
                        if delta.finish_reason is not None:
                            running.discard(delta.request_id)
                        yield index[delta.request_id], delta
                for mark in marks:
                    if mark is _DEAD:
                        raise EngineDeadError(self.dead_reason)
                    if isinstance(mark, StreamCut):
                        raise mark
                if not deltas and running and _IDLE in marks:
                    yield IDLE  # type: ignore[misc]
        finally:
            inbox.close()
            for rid in ids:
                self._queues.pop(rid, None)
                unstarted.pop(rid, None)
            ticket.release()
            if running and self.healthy:
                self._send(Abort(sorted(running)))

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        tenant: str = "",
        priority: int = 0,
    ) -> AsyncIterator[TextDelta]:
        """One choice; ends after the delta carrying its finish_reason."""
        stream = self.generate_n(
            request_id, prompt_token_ids, [params], tenant=tenant, priority=priority
        )
        try:
            async for _, delta in stream:
                yield delta
        finally:
            await stream.aclose()

    async def get_stats(self, timeout_s: float = 1.0) -> EngineStats:
        return await self._ask(lambda token: GetStats(self.frontend_id, token), timeout_s)

    async def get_timeline(self, last: int, timeout_s: float = 2.0) -> Timeline:
        return await self._ask(lambda token: GetTimeline(self.frontend_id, token, last), timeout_s)

    async def _ask(self, make: Callable[[int], CoreInput], timeout_s: float):
        """Send one question to the core and wait for the answer carrying the same token."""
        if not self.healthy:
            raise EngineDeadError(self.dead_reason)
        token = next(self._counter)
        waiter: asyncio.Future = asyncio.get_running_loop().create_future()
        self._replies[token] = waiter
        self._send(make(token))
        try:
            return await asyncio.wait_for(waiter, timeout_s)
        finally:
            self._replies.pop(token, None)


class ZmqEngineClient(EngineClient):
    """EngineClient over the engine's sockets: PUSH to the core, PULL on our return socket."""

    def __init__(self, config: EngineConfig, frontend_id: int, ctx: zmq.Context) -> None:
        self._sender: Sender[CoreInput] = Sender(ctx, config.ipc(CORE_IN))
        super().__init__(frontend_id, self._sender.send, config.stream_buffer_events)
        self._actx = zmq.asyncio.Context()
        self._receiver: AsyncReceiver[FrontendInput] = AsyncReceiver(
            self._actx, config.ipc(frontend_socket(frontend_id)), FrontendInput
        )
        self._listener: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the listener task; call inside the running loop."""
        assert self._listener is None, "started twice"
        self._listener = asyncio.get_running_loop().create_task(self._listen(), name="listener")
        self._listener.add_done_callback(self._listener_done)

    async def _listen(self) -> None:
        receiver = self._receiver
        burst = max(1, self.max_pending // 4)
        while True:
            msg = await receiver.recv()
            # why: a frame already here makes recv() return without yielding, so a frontend
            # that fell behind would dispatch its whole backlog before any stream wrote,
            # the streams' unsent deltas passing max_pending as if their clients had stopped
            # reading. Frames that wait are dispatched a burst at a time (at most a quarter
            # of max_pending, or BURST_S), then every stream writes what came as one event.
            # The streams' `direct` gets the burst's deltas at its end, joined: an event per
            # frame, written at once, is what a frontend behind cannot afford.
            # A frame is held only once the next is in hand: a wait with deltas held would
            # keep them from their streams until some frame came.
            until = time.perf_counter() + BURST_S
            try:
                for _ in range(burst - 1):
                    following = await receiver.recv_waiting()
                    if following is None:
                        break
                    self.dispatch(msg, flush=False)
                    msg = following
                    if time.perf_counter() > until:
                        break
                self.dispatch(msg)
            finally:
                self.flush_held()
            await asyncio.sleep(0)

    def _listener_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._mark_dead(f"the frontend's engine listener failed: {task.exception()!r}")

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.gather(self._listener, return_exceptions=True)
        self._receiver.close()
        self._sender.close()
        self._actx.term()
