"""Typed ZMQ channels: the codec and bind/connect side are fixed when a channel is made."""

from __future__ import annotations

from typing import Generic, TypeVar

import msgspec
import zmq

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()


class Sender(Generic[T]):
    """PUSH side. `bind=False` connects, which is what most senders do."""

    def __init__(self, ctx: zmq.Context, address: str, *, bind: bool = False) -> None:
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        (self.socket.bind if bind else self.socket.connect)(address)

    def send(self, msg: T) -> None:
        self.socket.send(_encoder.encode(msg), copy=False)

    def close(self) -> None:
        self.socket.close(linger=0)


class Receiver(Generic[T]):
    """PULL side; binds by default. Decodes straight into the channel's tagged union."""

    def __init__(
        self, ctx: zmq.Context, address: str, union: type[T], *, bind: bool = True
    ) -> None:
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        (self.socket.bind if bind else self.socket.connect)(address)
        self._decoder = msgspec.msgpack.Decoder(union)

    def recv(self, timeout_ms: int | None = None) -> T | None:
        """One message, or None when none came within timeout_ms (None blocks forever)."""
        if timeout_ms is not None and not self.socket.poll(timeout_ms):
            return None
        return self._decoder.decode(self.socket.recv(copy=False).buffer)

    def drain(self) -> list[T]:
        """Every message already waiting, without blocking."""
        out: list[T] = []
        while True:
            try:
                frame = self.socket.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return out
            out.append(self._decoder.decode(frame.buffer))

    def close(self) -> None:
        self.socket.close(linger=0)


class AsyncReceiver(Generic[T]):
    """PULL side for an asyncio loop (zmq.asyncio context)."""

    def __init__(self, ctx, address: str, union: type[T], *, bind: bool = True) -> None:
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        (self.socket.bind if bind else self.socket.connect)(address)
        self._decoder = msgspec.msgpack.Decoder(union)

    async def recv(self) -> T:
        frame = await self.socket.recv(copy=False)
        return self._decoder.decode(frame.buffer)

    def close(self) -> None:
        self.socket.close(linger=0)
