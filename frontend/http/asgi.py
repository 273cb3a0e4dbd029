"""Raw ASGI plumbing: request head and bounded body, JSON and SSE responses, disconnects."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import msgspec

from gapless.frontend.http.errors import ApiError

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
T = TypeVar("T")

encoder = msgspec.json.Encoder()

_JSON = [(b"content-type", b"application/json")]
_SSE = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_DONE = b"data: [DONE]\n\n"
_KEEPALIVE = b": keep-alive\n\n"
WATCH_TICK_S = 0.5  # how often a stream's writes are looked at
# the scope extension with a server's `write_now(chunk) -> bool` (frontend/http/transport.py)
CHUNK_WRITER = "gapless.chunk_writer"
# the scope extension with a server's StreamConnection (frontend/http/transport.py): what the client
# has left unread, a bound on the kernel's send buffer, an end written past flow control
STREAM_CONNECTION = "gapless.stream_connection"


_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces


def request_id_of(header: str | None) -> str:
    """The client's X-Request-Id if it is a sane one, else a new one."""
    if header is not None and _REQUEST_ID.fullmatch(header):
        return header
    return uuid.uuid4().hex


@dataclass
class RequestStats:
    """What the access line reports of a generation request; filled as it runs."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None  # from arrival to the first token at the frontend
    finish_reason: str | None = None


class HttpRequest:
    """The head of one HTTP request; the body is read once, bounded, with `body()`."""

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self.scope = scope
        self.receive = receive
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        # lower-case names; a repeated header keeps its last value
        self.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        self.request_id = request_id_of(self.headers.get("x-request-id"))
        self.stats = RequestStats()

    async def body(self, max_bytes: int) -> bytes:
        """The whole body, or 413 as soon as it is known to exceed max_bytes."""
        length = self.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_bytes:
            raise _too_large(max_bytes)
        chunks, size = [], 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(max_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(
        413, f"the request body is larger than {max_bytes} bytes", code="body_too_large"
    )


class ClientGone(Exception):
    """The client disconnected; nothing more can be sent."""


class SlowReader(Exception):
    """The client stopped reading its stream (`reason`: "buffer" or "write_timeout")."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason

    def error(self) -> ApiError:
        """What the stream's last event says."""
        return ApiError(408, str(self), code="slow_reader")


class StreamConnection(Protocol):
    """What a server tells of one request's connection (STREAM_CONNECTION)."""

    def unsent_bytes(self) -> tuple[int, int | None]:
        """Bytes written for the client and not yet taken: (those the transport holds, those
        in the kernel's send queue that the client has not acknowledged, or None where that
        cannot be read). The transport's share waits on the client only while the kernel's
        is full, and on this process's event loop otherwise."""
        ...

    def limit_send_buffer(self) -> None:
        """Bounds the kernel's send buffer (which grows to megabytes), so that a client that
        stops reading soon holds the stream's writes back through flow control."""
        ...

    def end_now(self, body: bytes) -> bool:
        """Writes body as the chunked response's last chunk at once, whatever the client left
        unread, ends the response and closes the connection once it is out (or after a
        grace, unread). False (nothing written) if the response is not a started chunked body
        or the connection is gone."""
        ...


class Responder:
    """Sends one response: a JSON body, or an SSE stream started on its first event.

    `write_now`, where the server gives one (frontend/http/transport.py, CHUNK_WRITER), writes a body
    chunk at once or returns False; `event_now` uses it for the usual event of a stream.
    `connection` (STREAM_CONNECTION), where set, lets `end_now` cut a stream."""

    def __init__(
        self,
        send: Send,
        headers: Sequence[tuple[bytes, bytes]] = (),
        write_now: Callable[[bytes], bool] | None = None,
    ) -> None:
        self._send = send
        self._write_now = write_now
        self._headers = list(headers)  # on every response (X-Request-Id)
        self.status = 0  # sent; 0 until a response starts
        self.started = False
        self.streaming = False
        self.finished = False
        self.connection: StreamConnection | None = None
        # SSE bytes (without the chunk framing) and events written so far, for SlowReaderWatch
        self.sent_bytes = 0
        self.sent_events = 0

    async def json(
        self, status: int, body: Any, headers: Sequence[tuple[bytes, bytes]] = ()
    ) -> None:
        payload = encoder.encode(body)
        head = [*_JSON, (b"content-length", str(len(payload)).encode()), *headers, *self._headers]
        self.started, self.status = True, status
        await self._send({"type": "http.response.start", "status": status, "headers": head})
        await self._send({"type": "http.response.body", "body": payload})
        self.finished = True

    async def raw(self, status: int, payload: bytes, content_type: bytes) -> None:
        """A body already encoded, with its content type."""
        head = [(b"content-type", content_type), (b"content-length", str(len(payload)).encode())]
        head += self._headers
        self.started, self.status = True, status
        await self._send({"type": "http.response.start", "status": status, "headers": head})
        await self._send({"type": "http.response.body", "body": payload})
        self.finished = True

    async def event(self, payload: bytes) -> None:
        """One SSE `data:` event holding already encoded JSON."""
        await self._stream_write(b"data: " + payload + b"\n\n")

    def event_now(self, payload: bytes) -> bool:
        """`event`, done at once without awaiting: True if written, False (nothing written)
        if the stream has not started, has ended, or cannot take it without a wait."""
        write = self._write_now
        if write is None or not self.streaming or self.finished:
            return False
        data = b"data: " + payload + b"\n\n"
        if not write(data):
            return False
        self.sent_bytes += len(data)
        self.sent_events += 1
        return True

    async def frames(self, data: bytes) -> None:
        """SSE events already framed (`event:` and `data:` lines each)."""
        await self._stream_write(data)

    async def end_stream(self) -> None:
        """The end of a stream that closes without [DONE] (the Responses API's)."""
        if not self.started:
            await self._start_stream()
        self.finished = True
        await self._send({"type": "http.response.body", "body": b""})

    async def comment(self) -> None:
        """An SSE comment, which clients ignore: it keeps proxies from cutting a quiet stream."""
        await self._stream_write(_KEEPALIVE)

    async def _stream_write(self, data: bytes) -> None:
        if not self.started:
            await self._start_stream()
        self.sent_bytes += len(data)
        self.sent_events += 1
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def done(self) -> None:
        """`data: [DONE]` and the end of the stream."""
        if not self.started:
            await self._start_stream()
        self.finished = True
        await self._send({"type": "http.response.body", "body": _DONE})

    async def _start_stream(self) -> None:
        self.started = self.streaming = True
        self.status = 200
        head = [*_SSE, *self._headers]
        await self._send({"type": "http.response.start", "status": 200, "headers": head})

    async def error(self, exc: ApiError) -> None:
        """The error as a JSON response, or as an SSE error event when the stream has begun."""
        if self.finished:
            return
        if not self.started:
            await self.json(exc.status, exc.body(), exc.headers)
        elif self.streaming:
            await self.event(encoder.encode(exc.body()))
            await self.done()

    def cut_now(self, frames: bytes) -> bool:
        """Cuts a started stream with SSE frames of its own (no [DONE]), written at once past
        flow control, as `end_now` does; False (nothing written) where that cannot be done."""
        if self.connection is None or not self.streaming or self.finished:
            return False
        if not self.connection.end_now(frames):
            return False
        self.finished = True
        return True

    def end_now(self, exc: ApiError, events: Sequence[bytes] = ()) -> bool:
        """Cuts a started stream: `events` (encoded JSON each), the error event and [DONE],
        written at once past flow control (a client that left its stream unread gets them
        after what it left), then the connection closes. False (nothing written) where that
        cannot be done: no connection given, the stream not started or already ended."""
        if self.connection is None or not self.streaming or self.finished:
            return False
        data = [b"data: " + payload + b"\n\n" for payload in (*events, encoder.encode(exc.body()))]
        if not self.connection.end_now(b"".join(data) + _DONE):
            return False
        self.finished = True
        return True


class SlowReaderWatch:
    """Judges a stream's client by what it has not taken off the socket, looked at every
    WATCH_TICK_S. Bytes the kernel holds unacknowledged wait on the client; bytes the transport
    holds, and deltas that wait for the stream's handler, may wait on this process's event
    loop instead (a busy loop writes late), so they count against a client only while it is
    stuck: the kernel held bytes for it at the last look and still does, none of them taken
    (a client that reads acknowledges them within a round trip).

    A stream is cut when its events unread in the kernel (at the stream's mean event size),
    and while it is stuck the tokens waiting for its handler (`waiting()`), pass max_events
    ("buffer"), or when it stays stuck for write_timeout_s ("write_timeout"). Where the
    kernel's queue cannot be read, the transport's bytes stand in for it."""

    def __init__(
        self,
        out: Responder,
        connection: StreamConnection,
        write_timeout_s: float,
        max_events: int,
        waiting: Callable[[], int] | None = None,
    ) -> None:
        self.out = out
        self.connection = connection
        self.write_timeout_s = write_timeout_s
        self.max_events = max_events
        self.waiting = waiting
        self._taken = 0  # most bytes the client was seen to have taken
        self._unread = 0  # bytes that waited on the client at the last look
        self._clear_at: float | None = None  # monotonic: the last look it was not stuck

    def check(self, now: float) -> SlowReader | None:
        out = self.out
        held, queued = self.connection.unsent_bytes()
        unread = held if queued is None else queued  # what waits on the client
        # the response head and chunk framing are not in sent_bytes: they only make the
        # client's share look smaller, never larger; bytes our loop moves from the transport
        # to the kernel leave it as it was
        taken = out.sent_bytes - held - (queued or 0)
        stuck = unread > 0 and self._unread > 0 and taken <= self._taken
        self._taken, self._unread = max(self._taken, taken), unread
        if not stuck or self._clear_at is None:
            self._clear_at = now
        elif now - self._clear_at > self.write_timeout_s:
            return SlowReader(
                "write_timeout",
                f"the client read nothing of its stream for {self.write_timeout_s:g} s",
            )
        events = unread * out.sent_events / out.sent_bytes if out.sent_bytes else 0.0
        if stuck and self.waiting is not None:
            events += self.waiting()
        if events > self.max_events:
            return SlowReader("buffer", f"the client left over {self.max_events} events unread")
        return None


async def until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(
    receive: Receive, work: Coroutine[Any, Any, T], watch: SlowReaderWatch | None = None
) -> T:
    """Runs `work`, cancelling it when the client disconnects first (raises ClientGone), or,
    given `watch`, when that finds the client is not reading (raises its SlowReader)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnect(receive))
    slow = None
    tick = None if watch is None else min(WATCH_TICK_S, watch.write_timeout_s)
    try:
        while True:
            done, _ = await asyncio.wait(
                (task, watcher), timeout=tick, return_when=asyncio.FIRST_COMPLETED
            )
            if done:
                break
            assert watch is not None
            slow = watch.check(time.monotonic())
            if slow is not None:
                break
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if slow is not None:
        raise slow
    if task.cancelled():
        raise ClientGone
    return task.result()
