"""Typed ZMQ channels: the codec and bind/connect side are fixed when a channel is made.

A Sender made with `shm=True` puts large encoded messages in a shared-memory ring it owns
(shm/ring.py) and sends only a small reference frame (shm/frames.py); smaller ones stay inline.
Use it only where this Sender is the one producer of its kind on the socket (core -> runner,
runner -> core, core -> detokenizer); other senders (the supervisor's Shutdown) may share the
socket. Every receiver reads both kinds of frame: there is nothing to enable on that side.

A Publisher sends each message once to every Subscriber (the core's plans to the ranks of a
tensor-parallel group): one encode and one send, ZMQ's I/O thread writes it to every pipe.
"""

from __future__ import annotations

import logging
import os
import select
import time
from typing import Generic, TypeVar

import msgspec
import zmq

from gapless.common.metrics import bad_frames_counter
from gapless.shm.frames import BadRef, RingReader, RingWriter, is_ref
from gapless.shm.names import ring_name, run_id_of

T = TypeVar("T")
log = logging.getLogger("gapless.channel")

_encoder = msgspec.msgpack.Encoder()

# Messages of at least this many encoded bytes go through the ring on shm channels.
# measured (tests/shm/test_bench_transport.py: round trip to another process, decode into bytes,
# median, 2-core x86 under load): zmq frames win up to 16 KB (16 KB: 67 vs 72 us), tie at 32 KB
# (75 vs 79 us), the ring wins from 64 KB (104 vs 91 us; 256 KB: 256 vs 183; 1 MB: 724 vs 558)
SHM_THRESHOLD = 64 * 1024
SHM_CAPACITY = 4 * 2**20  # bytes of ring per shm sender; a message that finds it full goes inline
# a receiver over tcp:// pings its peer this often; a peer silent 3 times as long is lost
HEARTBEAT_MS = 1000


def _ring_for(address: str, capacity: int, threshold: int) -> RingWriter:
    if not address.startswith("ipc://"):
        raise ValueError(f"shm needs an ipc:// address inside the run directory, not {address}")
    run_dir, channel = os.path.split(address.removeprefix("ipc://"))
    return RingWriter(ring_name(run_id_of(run_dir), channel), capacity, threshold)


class Sender(Generic[T]):
    """PUSH side. `bind=False` connects, which is what most senders do.

    `shm=True`: messages of `shm_threshold` encoded bytes or more travel in a ring of
    `shm_capacity` bytes named after the run and the socket (`gapless-<run_id>-<socket>-...`).
    """

    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        *,
        bind: bool = False,
        shm: bool = False,
        shm_capacity: int = SHM_CAPACITY,
        shm_threshold: int = SHM_THRESHOLD,
    ) -> None:
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        (self.socket.bind if bind else self.socket.connect)(address)
        self._ring = _ring_for(address, shm_capacity, shm_threshold) if shm else None

    def send(self, msg: T) -> None:
        data = _encoder.encode(msg)
        if self._ring is not None:
            if self._ring.announcement is not None:
                self.socket.send(self._ring.announcement)
                self._ring.announcement = None
            data = self._ring.frame(data)
        self.socket.send(data, copy=False)

    def close(self) -> None:
        self.socket.close(linger=0)
        if self._ring is not None:
            self._ring.close()
            self._ring = None


_BAD_FRAME_ERRORS = (msgspec.DecodeError, BadRef, UnicodeDecodeError, RecursionError)


class _Decoding(Generic[T]):
    """Frame -> message, following ring references; None for a frame that carries none.

    A frame that is not a message of the channel's union (undecodable, a reference to no ring
    of this run) is dropped: logged, counted in gapless_bad_frames_total{socket}, and the
    process goes on. Only this user's processes can reach the sockets, but one stray frame
    must not stop the engine.
    """

    def __init__(self, union: type[T], address: str) -> None:
        self._decoder = msgspec.msgpack.Decoder(union)
        path = address.removeprefix("ipc://")
        self.socket_name = os.path.basename(path) or address
        run_id = run_id_of(os.path.dirname(path)) if address.startswith("ipc://") else None
        self._rings = RingReader(run_id)
        self._bad = bad_frames_counter().labels(self.socket_name)
        self.num_bad = 0

    def decode(self, buf: memoryview) -> T | None:
        try:
            return self._decode(buf)
        except _BAD_FRAME_ERRORS as e:
            self.num_bad += 1
            self._bad.inc()
            if self.num_bad <= 10 or self.num_bad % 1000 == 0:  # why: a flood must not flood logs
                log.warning(
                    "dropped a malformed frame of %d bytes on %s (%d so far): %s: %s",
                    len(buf), self.socket_name, self.num_bad, type(e).__name__, e,
                )  # fmt: skip
            return None

    def _decode(self, buf: memoryview) -> T | None:
        if not is_ref(buf):
            return self._decoder.decode(buf)
        got = self._rings.open(buf)
        if got is None:
            return None
        ring, view = got
        try:
            return self._decoder.decode(view)
        finally:
            view.release()
            ring.release()

    def close(self) -> None:
        self._rings.close()


class Publisher(Generic[T]):
    """XPUB side, bound: every message goes to every subscriber. A subscriber that has not
    joined yet misses it, so the first message waits for wait_subscribers."""

    def __init__(self, ctx: zmq.Context, *addresses: str) -> None:
        self.socket = ctx.socket(zmq.XPUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's join, not the first
        for address in addresses:
            self.socket.bind(address)
        self.num_subscribers = 0

    def wait_subscribers(self, n: int, timeout_ms: int) -> bool:
        """Whether n subscribers have joined, waiting up to timeout_ms for them."""
        deadline = time.monotonic() + timeout_ms / 1000
        while self.num_subscribers < n:
            left_ms = round((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self.socket.poll(left_ms):
                return False
            frame = self.socket.recv()
            if frame[:1] == b"\x01":  # a subscription; b"\x00" is one leaving
                self.num_subscribers += 1
        return True

    def send(self, msg: T) -> None:
        self.socket.send(_encoder.encode(msg), copy=False)

    def close(self, linger_ms: int = 0) -> None:
        self.socket.close(linger=linger_ms)


class Receiver(Generic[T]):
    """PULL side; binds by default. Decodes straight into the channel's tagged union."""

    socket_type = zmq.PULL

    def __init__(
        self, ctx: zmq.Context, address: str, union: type[T], *, bind: bool = True
    ) -> None:
        self.socket = ctx.socket(self.socket_type)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        if self.socket_type == zmq.SUB:
            self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        if address.startswith("tcp://"):  # ping the peer; a silent one drops the connection
            self.socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
            self.socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * HEARTBEAT_MS)
        (self.socket.bind if bind else self.socket.connect)(address)
        self._decoding = _Decoding(union, address)
        self._fd = self.socket.getsockopt(zmq.FD)

    def recv(self, timeout_ms: int | None = None) -> T | None:
        """One message, or None when none came within timeout_ms (None blocks forever)."""
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while True:
            if deadline is not None:
                left_ms = max(0, round((deadline - time.monotonic()) * 1000))
                if not self.socket.poll(left_ms):
                    return None
            msg = self._decoding.decode(self.socket.recv(copy=False).buffer)
            if msg is not None:
                return msg

    def wait(self, timeout_s: float) -> bool:
        """Whether a frame is waiting, waiting for one up to timeout_s.

        why not zmq's poll: it counts whole milliseconds, and a runner that let a plan wait
        for the next millisecond while a 2 ms step ran left the device idle ~0.6 ms every other
        step (sim); the socket's FD is edge-triggered, so EVENTS is read before every wait."""
        deadline = time.perf_counter() + timeout_s
        while not self.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            left_s = deadline - time.perf_counter()
            if left_s <= 0:
                return False
            select.select([self._fd], [], [], left_s)
        return True

    def drain(self) -> list[T]:
        """Every message already waiting, without blocking."""
        out: list[T] = []
        while True:
            try:
                frame = self.socket.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return out
            msg = self._decoding.decode(frame.buffer)
            if msg is not None:
                out.append(msg)

    def close(self) -> None:
        self.socket.close(linger=0)
        self._decoding.close()


class Subscriber(Receiver[T]):
    """SUB side of a Publisher's channel, connected; reads as a Receiver does.

    Over tcp:// (another host's publisher) the connection is heartbeated, and `lost()` says
    whether it dropped after it was made: a publisher killed, or its host gone silent."""

    socket_type = zmq.SUB

    def __init__(self, ctx: zmq.Context, address: str, union: type[T]) -> None:
        super().__init__(ctx, address, union, bind=False)
        self._monitor = None
        if address.startswith("tcp://"):
            self._monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    def lost(self) -> bool:
        """Whether the publisher's connection dropped (never, over ipc://); does not block."""
        return self._monitor is not None and bool(self._monitor.poll(0))

    def close(self) -> None:
        if self._monitor is not None:
            self.socket.disable_monitor()
            self._monitor.close(linger=0)
        super().close()


class AsyncReceiver(Generic[T]):
    """PULL side for an asyncio loop (zmq.asyncio context)."""

    def __init__(self, ctx, address: str, union: type[T], *, bind: bool = True) -> None:
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        (self.socket.bind if bind else self.socket.connect)(address)
        self._decoding = _Decoding(union, address)

    async def recv(self) -> T:
        while True:
            frame = await self.socket.recv(copy=False)
            msg = self._decoding.decode(frame.buffer)
            if msg is not None:
                return msg

    async def recv_waiting(self) -> T | None:
        """A message already here, without waiting (nor yielding to the loop); None when none
        is, malformed frames skipped."""
        while True:
            try:
                frame = await self.socket.recv(flags=zmq.DONTWAIT, copy=False)
            except zmq.Again:
                return None
            msg = self._decoding.decode(frame.buffer)
            if msg is not None:
                return msg

    def close(self) -> None:
        self.socket.close(linger=0)
        self._decoding.close()
