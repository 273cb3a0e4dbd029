"""uvicorn's httptools protocol with a bound on the request head (request line and headers),
and a way to write a streaming body's chunk without a trip through the ASGI `send`.

httptools collects a header's value in full before any callback sees it, so the bound is kept
on the bytes read while a head is incomplete: past `max_head_bytes` the connection gets a 431
and is closed at once, before the app (and its API-key check) runs and before reading more.

Each request's scope carries, under `extensions[CHUNK_WRITER]`, a callable that writes one
chunk of a started chunked body at once and returns True, or returns False and writes nothing
when that cannot be done without waiting (the client is gone, the transport asked to pause,
the response is not a chunked body in progress): the frontend's engine listener writes a
stream's usual SSE event through it while the stream's handler waits for its next delta
(frontend/api/stream.py, `RequestStream.write_now`), instead of waking the handler for it; and,
under `extensions[STREAM_CONNECTION]`, a `Connection` that tells how much of what was written
the client has not taken yet, bounds the kernel's send buffer, and ends a cut stream at once.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import socket
import struct
import termios
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from gapless.frontend.http import metrics
from gapless.frontend.http.asgi import CHUNK_WRITER, STREAM_CONNECTION, encoder
from gapless.frontend.http.errors import ApiError

log = logging.getLogger("gapless.frontend")

# bytes asked of the kernel for a stream's send buffer (Linux grants twice as much for its own
# bookkeeping); a stream carries a few hundred bytes per step, and the default grows to
# megabytes, which a client that stops reading fills unseen for minutes
STREAM_SEND_BUFFER = 64 * 2**10
CLOSE_GRACE_S = 5.0  # s: how long a cut stream's last bytes may wait for its client
_OUTQ = getattr(termios, "TIOCOUTQ", None)  # == SIOCOUTQ on Linux: bytes not yet acknowledged


def chunk_writer(cycle: RequestResponseCycle) -> Callable[[bytes], bool]:
    """Writes one body chunk of `cycle`'s response, as its `send` would with more_body, if
    that needs no wait; the same state `send` keeps decides."""

    def write(body: bytes) -> bool:
        if (
            cycle.disconnected
            or cycle.transport.is_closing()  # why: uvicorn marks only the current cycle
            or cycle.flow.write_paused
            or not cycle.response_started
            or cycle.response_complete
            or not cycle.chunked_encoding
            or not body
        ):
            return False
        cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        return True

    return write


class Connection:
    """One request's connection, as asgi.StreamConnection describes it."""

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = cycle
        self._socket = cycle.transport.get_extra_info("socket")

    def _open(self) -> bool:
        cycle = self._cycle
        return not (cycle.disconnected or cycle.transport.is_closing())

    def unsent_bytes(self) -> tuple[int, int | None]:
        if not self._open():
            return 0, 0
        held = self._cycle.transport.get_write_buffer_size()
        if self._socket is None or _OUTQ is None:
            return held, None
        try:
            queued = fcntl.ioctl(self._socket.fileno(), _OUTQ, b"\0\0\0\0")
        except OSError:  # a socket the ioctl does not know (another platform)
            return held, None
        return held, struct.unpack("i", queued)[0]

    def limit_send_buffer(self) -> None:
        if self._socket is not None and self._open():
            try:
                self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SEND_BUFFER)
            except OSError:
                log.debug("could not bound a stream's send buffer", exc_info=True)

    def end_now(self, body: bytes) -> bool:
        cycle = self._cycle
        if (
            not self._open()
            or not cycle.response_started
            or cycle.response_complete
            or not cycle.chunked_encoding
            or not body
        ):
            return False
        transport = cycle.transport
        cycle.keep_alive = False
        transport.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body))
        cycle.response_complete = True
        cycle.message_event.set()
        transport.close()  # once what it holds is written
        asyncio.get_running_loop().call_later(CLOSE_GRACE_S, transport.abort)
        cycle.on_response()
        return True


def head_limited(max_head_bytes: int) -> type[HttpToolsProtocol]:
    """The protocol class for uvicorn.Config(http=...), answering 431 past max_head_bytes."""

    class HeadLimitedProtocol(HttpToolsProtocol):
        _reading_head = True  # between the end of one message and the end of the next head
        _head_bytes = 0  # read since the current head began (body bytes of its chunk included)

        def data_received(self, data: bytes) -> None:
            if self._reading_head:
                self._head_bytes += len(data)
            super().data_received(data)
            if self._reading_head and self._head_bytes > max_head_bytes:
                self._reject()

        def on_headers_complete(self) -> None:
            self._reading_head, self._head_bytes = False, 0
            super().on_headers_complete()
            cycle = self.cycle
            if cycle is not None and cycle.scope is self.scope:  # not an upgrade
                extensions = self.scope.setdefault("extensions", {})
                extensions[CHUNK_WRITER] = chunk_writer(cycle)
                extensions[STREAM_CONNECTION] = Connection(cycle)

        def on_message_complete(self) -> None:
            self._reading_head = True
            super().on_message_complete()

        def _reject(self) -> None:
            self._reading_head, self._head_bytes = False, 0
            if self.transport.is_closing():
                return
            error = ApiError(
                431,
                f"the request line and headers are larger than {max_head_bytes} bytes",
                code="headers_too_large",
            )
            body = encoder.encode(error.body())
            log.warning(
                "closed a connection from %s: request head over %d bytes",
                self.client,
                max_head_bytes,
            )
            metrics.observer.rejected("headers_too_large")
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                b"content-type: application/json\r\n"
                b"content-length: " + str(len(body)).encode() + b"\r\n"
                b"connection: close\r\n\r\n" + body
            )
            self.transport.close()

    return HeadLimitedProtocol
