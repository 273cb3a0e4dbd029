"""The frontend's side of the engine: send AddRequest / Abort, fan TextDeltas out per request.

One listener task reads the frontend's return socket and hands each TextDelta to the inbox of
the request it belongs to (`add` routes a request's choices there, `remove` stops it and aborts
what still runs); a RequestStream (frontend/api/stream.py) takes from that inbox.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio
from prometheus_client import Counter

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
    LoadLora,
    LoraAdapters,
    PrefixCacheReset,
    QueueState,
    ResetPrefixCache,
    TextDeltas,
    Timeline,
    UnloadLora,
)
from gapless.common.process import CORE_IN, frontend_socket
from gapless.frontend.engine.inbox import Inbox, coalesced
from gapless.frontend.engine.queue_view import QueueView, Ticket
from gapless.frontend.engine.replicas import ReplicaRouter, routed_counter

log = logging.getLogger("gapless.frontend")

DEAD = object()  # inbox marker: the engine died while the request was in flight


class EngineDeadError(Exception):
    """The engine is gone; every in-flight and later request fails with this."""


class StreamCut(Exception):
    """The frontend ended the request itself before the engine did (the drain ran out of
    time); the message says why. Its choices still running are aborted in the engine."""


# s: the longest the listener dispatches frames that waited before the streams write; bounds
# how long a stream goes without an event while its frontend is behind
BURST_S = 0.01


class EngineClient:
    """Request bookkeeping over a `send` callable per engine replica (one, or a list for
    --data-parallel-size); `dispatch` is fed every FrontendInput.

    `add` / `remove` are the contract a RequestStream (and test doubles) rely on.
    """

    def __init__(
        self,
        frontend_id: int,
        send: Callable[[CoreInput], None] | list[Callable[[CoreInput], None]],
        max_pending: int = 1024,
        block_size: int = 16,
        routed: Counter | None = None,
    ) -> None:
        self.frontend_id = frontend_id
        self._sends = send if isinstance(send, list) else [send]
        self.router = ReplicaRouter(len(self._sends), frontend_id, block_size, routed)
        # engine id -> (its replica, its prompt tokens until it starts), while it runs; empty
        # with one replica
        self._routed: dict[str, tuple[int, int]] = {}
        # deltas one request may have waiting for its handler before they are joined into one
        # per choice (its handler would join them all the same when it runs)
        self.max_pending = max_pending
        self.queue = QueueView(frontend_id)  # what waits for a seat, for admission control
        self.healthy = True
        self.dead_reason = ""
        # engine id -> inbox of (delta, perf_counter when its TextDeltas arrived), DEAD, IDLE
        # or a StreamCut
        self._queues: dict[str, Inbox] = {}
        self._counter = itertools.count()
        self._replies: dict[int, asyncio.Future] = {}  # token -> answer of the core
        self._held: list[Inbox] = []  # inboxes holding deltas until flush_held
        self._on_dead: list[Callable[[str], None]] = []
        # of each replica's core; they were READY before we started
        self._heartbeats = [time.monotonic()] * len(self._sends)
        # of each replica's last heartbeat: (seconds a step's result is overdue, usual seconds)
        self._stalls = [(0.0, 0.0)] * len(self._sends)
        # the LoRA adapters served now, as the cores last said; None: --lora-modules' (no
        # adapter loaded or unloaded since start)
        self.lora_names: list[str] | None = None

    def next_request_id(self) -> str:
        return f"{self.frontend_id}-{next(self._counter)}"

    def core_silent_s(self) -> float:
        """Seconds since the last heartbeat of the core heard from least recently."""
        return time.monotonic() - min(self._heartbeats)

    def stalled(self) -> str:
        """Why the engine makes no progress though its cores turn ('' while it does): the
        replica whose runner owes a step's result the longest, by its core's last heartbeat."""
        overdue, replica = max((s[0], r) for r, s in enumerate(self._stalls))
        if overdue <= 0.0:
            return ""
        usual = self._stalls[replica][1]
        who = f"replica {replica}'s runner" if len(self._sends) > 1 else "the runner"
        return (
            f"{who} has owed a step's result for {overdue:.1f} s "
            f"(the slowest of its recent steps took {usual:.3f} s)"
        )

    @property
    def num_replicas(self) -> int:
        return len(self._sends)

    def on_dead(self, callback: Callable[[str], None]) -> None:
        self._on_dead.append(callback)

    def dispatch(self, msg: FrontendInput, flush: bool = True) -> None:
        """Hands what the engine sent to the requests it is for. An inbox with a `direct`
        (RequestStream.write_to) has its deltas held and, with `flush`, offered to it or its handler
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
                        self._started(rid)
                    inbox = queues.get(rid)
                    if inbox is None:  # the request was aborted here already
                        continue
                    # why not a cut: its handler is behind, which a busy event loop does to a
                    # client that reads as well as to one that does not (SlowReaderWatch
                    # tells them apart)
                    if len(inbox) >= self.max_pending:
                        inbox.compact(coalesced)
                    if inbox.direct is None:
                        inbox.put_delta((delta, received), received)
                    elif inbox.hold((delta, received), received):
                        held.append(inbox)
                if flush:
                    self.flush_held()
            case QueueState(replica=replica) if 0 <= replica < len(self._sends):
                self.queue.update(msg)
                self.router.update(msg)
            case Heartbeat(replica=replica) if 0 <= replica < len(self._sends):
                self._heartbeats[replica] = time.monotonic()
                self._stalls[replica] = (msg.stalled_s, msg.usual_s)
            case EngineDead(reason=reason):
                self._mark_dead(reason)
            case LoraAdapters(names=names, token=token):
                self.lora_names = names
                if token >= 0:
                    waiter = self._replies.pop(token, None)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(msg)
            case EngineStats(token=token) | Timeline(token=token) | PrefixCacheReset(token=token):
                waiter = self._replies.pop(token, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(msg)

    def flush_held(self) -> None:
        """Every held delta to its stream's `direct` or handler (Inbox.flush)."""
        held, self._held = self._held, []
        for inbox in held:
            inbox.flush()

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
            inbox.put(DEAD)
        for waiter in self._replies.values():
            if not waiter.done():
                waiter.set_exception(EngineDeadError(self.dead_reason))
        self._replies.clear()
        for callback in self._on_dead:
            callback(self.dead_reason)

    def add(self, requests: list[AddRequest], inbox: Inbox, ticket: Ticket) -> None:
        """Sends the engine requests, each one's deltas routed to `inbox` and counted as
        queued on `ticket` until its first delta comes; EngineDeadError if the engine is dead.
        Every request added is `remove`d once its stream ends."""
        if not self.healthy:
            raise EngineDeadError(self.dead_reason)
        queues, unstarted = self._queues, self.queue.unstarted
        for req in requests:
            queues[req.request_id] = inbox
            unstarted[req.request_id] = ticket
        if len(self._sends) == 1:
            send = self._sends[0]
            for req in requests:
                send(req)
            return
        # every choice of a request to one replica: they share the prompt's blocks there
        replica = self.router.choose(requests[0].block_hashes) if requests else 0
        send = self._sends[replica]
        for req in requests:
            self._routed[req.request_id] = (replica, len(req.prompt_token_ids))
            self.router.add(replica, req.block_hashes, len(req.prompt_token_ids))
            send(req)

    def _started(self, rid: str) -> None:
        """A request routed to a replica is no longer waiting there."""
        routed = self._routed.get(rid)
        if routed is not None and routed[1]:
            self.router.leave(*routed)
            self._routed[rid] = (routed[0], 0)

    def remove(self, request_ids: list[str], running: list[str]) -> None:
        """No more deltas of request_ids reach their inbox; those still `running` (some of
        request_ids) are aborted in the engine, if it is alive."""
        queues, unstarted, routed = self._queues, self.queue.unstarted, self._routed
        replicas: dict[str, int] = {}
        for rid in request_ids:
            queues.pop(rid, None)
            unstarted.pop(rid, None)
            if rid in routed:
                replica, waiting = routed.pop(rid)
                if waiting:  # it ended before it started
                    self.router.leave(replica, waiting)
                self.router.ended(replica)
                replicas[rid] = replica
        if not running or not self.healthy:
            return
        by_replica: dict[int, list[str]] = {}
        for rid in sorted(running):
            by_replica.setdefault(replicas.get(rid, 0), []).append(rid)
        for replica, rids in by_replica.items():
            self._sends[replica](Abort(rids))

    async def get_stats(self, timeout_s: float = 1.0, replica: int = 0) -> EngineStats:
        return await self._ask(lambda token: GetStats(self.frontend_id, token), timeout_s, replica)

    async def reset_prefix_cache(self, replica: int, timeout_s: float = 2.0) -> PrefixCacheReset:
        return await self._ask(
            lambda token: ResetPrefixCache(self.frontend_id, token), timeout_s, replica
        )

    async def load_lora(self, name: str, path: str, timeout_s: float) -> list[LoraAdapters]:
        """Every replica's core loads the adapter; their answers."""
        asks = [
            self._ask(lambda token: LoadLora(self.frontend_id, token, name, path), timeout_s, k)
            for k in range(len(self._sends))
        ]
        return await asyncio.gather(*asks)

    async def unload_lora(self, name: str, timeout_s: float) -> list[LoraAdapters]:
        """Every replica's core unloads the adapter; their answers."""
        asks = [
            self._ask(lambda token: UnloadLora(self.frontend_id, token, name), timeout_s, k)
            for k in range(len(self._sends))
        ]
        return await asyncio.gather(*asks)

    async def get_timeline(self, last: int, timeout_s: float = 2.0, replica: int = 0) -> Timeline:
        return await self._ask(
            lambda token: GetTimeline(self.frontend_id, token, last), timeout_s, replica
        )

    async def _ask(self, make: Callable[[int], CoreInput], timeout_s: float, replica: int):
        """Send one question to a replica's core and wait for the answer carrying the same
        token."""
        if not self.healthy:
            raise EngineDeadError(self.dead_reason)
        token = next(self._counter)
        waiter: asyncio.Future = asyncio.get_running_loop().create_future()
        self._replies[token] = waiter
        self._sends[replica](make(token))
        try:
            return await asyncio.wait_for(waiter, timeout_s)
        finally:
            self._replies.pop(token, None)


class ZmqEngineClient(EngineClient):
    """EngineClient over the engine's sockets: PUSH to the core, PULL on our return socket."""

    def __init__(self, config: EngineConfig, frontend_id: int, ctx: zmq.Context) -> None:
        self._senders: list[Sender[CoreInput]] = [
            Sender(ctx, config.engine_ipc(CORE_IN, k)) for k in range(config.data_parallel_size)
        ]
        super().__init__(
            frontend_id,
            [s.send for s in self._senders],
            config.stream_buffer_events,
            config.block_size,
            routed_counter() if config.data_parallel_size > 1 else None,
        )
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
        for sender in self._senders:
            sender.close()
        self._actx.term()
