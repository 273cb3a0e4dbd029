"""uvicorn's httptools protocol with every connection bounded in time and number (a head's
size and deadline, a body's rate, how many are open: `bounded_protocol`), and a way to write a
streaming body's chunk without a trip through the ASGI `send`.

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
import resource
import socket
import struct
import termios
from collections import OrderedDict
from collections.abc import Callable

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from gapless.common.config import EngineConfig
from gapless.common.metrics import CONNECTION_CLOSES
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


OPEN_PATHS = ("/health", "/live", "/metrics")  # what a connection past --max-connections may ask
OVER_CAP_HEAD_S = 2.0  # s: the head deadline of a connection past --max-connections
LOG_FIRST = 10  # closes of each reason logged one by one; then one in LOG_EVERY
LOG_EVERY = 1000


def connection_cap(config: EngineConfig) -> tuple[int, int]:
    """(--max-connections, how many more may come to ask /health, /live or /metrics before a new
    connection is answered 503 at once): by default half the file descriptor limit, and an
    eighth of it, so the frontend never runs out of descriptors however many clients hold
    connections."""
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if limit == resource.RLIM_INFINITY:
        limit = 2**16
    cap = config.max_connections or max(16, limit // 2)
    return cap, max(4, min(limit // 8, cap // 4 + 4))


class _Closes:
    """Counts and logs the connections the server closes or refuses, one line per reason for
    the first LOG_FIRST, then one in LOG_EVERY (with the count), so a flood of them cannot
    flood the log."""

    def __init__(self) -> None:
        self.counts = dict.fromkeys(CONNECTION_CLOSES, 0)

    def __call__(self, reason: str, client: object, detail: str) -> None:
        metrics.observer.connection_closed(reason)
        n = self.counts[reason] = self.counts[reason] + 1
        if n <= LOG_FIRST or n % LOG_EVERY == 0:
            log.warning("closed a connection from %s (%s, %d so far): %s", client, reason, n,
                        detail)  # fmt: skip


def _raw_error(status: int, error: ApiError) -> bytes:
    body = encoder.encode(error.body())
    return (
        b"HTTP/1.1 %d %b\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n%b" % (status, _REASONS[status], len(body), body)
    )


_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large",
            503: b"Service Unavailable"}  # fmt: skip


async def _busy(scope, receive, send) -> None:  # noqa: ANN001
    """The ASGI app a connection past --max-connections gets for anything but OPEN_PATHS."""
    error = ApiError(503, "the server holds as many connections as it takes; try again",
                     code="too_many_connections")  # fmt: skip
    body = encoder.encode(error.body())
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
        (b"connection", b"close"), (b"retry-after", b"1")]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


def bounded_protocol(config: EngineConfig) -> type[HttpToolsProtocol]:
    """The protocol class for uvicorn.Config(http=...): uvicorn's httptools protocol with every
    connection bounded in time and number (README, "Connections").

    - A head larger than max_head_bytes: 431, closed before the app runs.
    - A head not whole within --header-timeout of the connection's start (a keep-alive
      connection: of the first byte of its next head): closed, with a 408 if part of it came.
    - A body slower than --body-timeout plus one second per --body-min-rate bytes: 408, closed.
    - Past --max-connections open, a new connection closes the longest-idle one (no request
      and no byte of one: a new connection or a keep-alive one between requests); with none
      idle it may ask OPEN_PATHS within OVER_CAP_HEAD_S and gets 503 for anything else; past
      the reserve too, it gets a 503 at once. Never silence.
    """
    max_head = config.max_head_bytes
    cap, reserve = connection_cap(config)
    # connections with no request and no byte of one: new ones and keep-alive ones between
    # requests, the longest idle first
    idle: OrderedDict[HttpToolsProtocol, None] = OrderedDict()
    closes = _Closes()
    # connections open and not being closed for room (uvicorn's set keeps those until the loop
    # turns, which a burst of accepts never lets it do)
    live = [0]

    class BoundedProtocol(HttpToolsProtocol):
        _reading_head = True  # between the end of one message and the end of the next head
        _head_bytes = 0  # read since the current head began (body bytes of its chunk included)
        _timer: asyncio.TimerHandle | None = None  # the head's or the body's deadline
        _over_cap = False
        _counted = False  # in the open-connections gauge
        _live = False  # in live[0]

        def connection_made(self, transport) -> None:  # noqa: ANN001
            super().connection_made(transport)
            self._counted = self._live = True
            metrics.observer.connections(1)
            live[0] += 1
            n = live[0]
            if n > cap and idle:
                oldest, _ = idle.popitem(last=False)
                closes("idle_evicted", oldest.client, f"{n - 1} connections open")
                oldest._leave()
                oldest.transport.close()
                n -= 1
            if n > cap + reserve:
                closes("over_capacity", self.client, f"{n - 1} connections open, none idle")
                self._refuse()
                return
            self._over_cap = n > cap
            if not self._over_cap:
                idle[self] = None
            self._arm(OVER_CAP_HEAD_S if self._over_cap else config.header_timeout_s,
                      self._head_late)  # fmt: skip

        def connection_lost(self, exc: Exception | None) -> None:
            idle.pop(self, None)
            self._disarm()
            self._leave()
            if self._counted:
                self._counted = False
                metrics.observer.connections(-1)
            super().connection_lost(exc)

        def _leave(self) -> None:
            if self._live:
                self._live = False
                live[0] -= 1

        def data_received(self, data: bytes) -> None:
            if self._reading_head:
                if self._head_bytes == 0:
                    idle.pop(self, None)
                    if self._timer is None:  # a keep-alive connection's next head begins
                        self._arm(config.header_timeout_s, self._head_late)
                self._head_bytes += len(data)
            super().data_received(data)
            if self._reading_head and self._head_bytes > max_head:
                self._reject()

        def on_headers_complete(self) -> None:
            self._reading_head, self._head_bytes = False, 0
            self._disarm()
            if self._over_cap:
                path = httptools.parse_url(self.url).path.decode("latin-1")
                app, self.app = self.app, (self.app if path in OPEN_PATHS else _busy)
                try:
                    super().on_headers_complete()
                finally:
                    self.app = app
                if self.cycle is not None:
                    self.cycle.keep_alive = False
                if path not in OPEN_PATHS:
                    closes("over_capacity", self.client, f"{live[0]} connections open")
            else:
                super().on_headers_complete()
            cycle = self.cycle
            if cycle is not None and cycle.scope is self.scope:  # not an upgrade
                extensions = self.scope.setdefault("extensions", {})
                extensions[CHUNK_WRITER] = chunk_writer(cycle)
                extensions[STREAM_CONNECTION] = Connection(cycle)
                if cycle.more_body and self._has_body():
                    self._body_from, self._body_bytes = self.loop.time(), 0
                    self._arm(config.body_timeout_s, self._body_late)

        def on_body(self, body: bytes) -> None:
            self._body_bytes = getattr(self, "_body_bytes", 0) + len(body)
            super().on_body(body)

        def on_message_complete(self) -> None:
            self._reading_head = True
            self._disarm()
            super().on_message_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.timeout_keep_alive_task is not None:  # idle until its next head
                idle[self] = None

        # ---------------------------------------------------------------- deadlines

        def _has_body(self) -> bool:
            for name, value in self.headers:
                if name == b"transfer-encoding" or (name == b"content-length" and value != b"0"):
                    return True
            return False

        def _arm(self, seconds: float, then: Callable[[], None]) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, then)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _head_late(self) -> None:
            self._timer = None
            if self.transport.is_closing() or not self._reading_head:
                return
            began = self._head_bytes > 0
            closes("header_timeout", self.client, f"{self._head_bytes} bytes of a request head"
                   f" in {config.header_timeout_s:g} s" if began else "no request")  # fmt: skip
            if began:
                self.transport.write(_raw_error(408, ApiError(
                    408, f"the request head did not arrive within {config.header_timeout_s:g} s",
                    code="request_timeout")))  # fmt: skip
            self.transport.close()

        def _body_late(self) -> None:
            self._timer = None
            cycle = self.cycle
            if self.transport.is_closing() or cycle is None or not cycle.more_body:
                return
            allowed = config.body_timeout_s + self._body_bytes / config.body_min_rate
            left = self._body_from + allowed - self.loop.time()
            if left > 0:  # the bytes that came bought more time
                self._arm(left, self._body_late)
                return
            closes("body_timeout", self.client, f"{self._body_bytes} body bytes in "
                   f"{self.loop.time() - self._body_from:.1f} s")  # fmt: skip
            if not cycle.response_started:
                cycle.response_started = True  # why: the app's own answer would come after
                self.transport.write(_raw_error(408, ApiError(
                    408, f"the request body came slower than {config.body_min_rate} bytes/s",
                    code="request_timeout")))  # fmt: skip
            self.transport.close()

        def _refuse(self) -> None:
            self._leave()
            error = ApiError(503, "the server holds as many connections as it takes; try "
                             "again", code="too_many_connections")  # fmt: skip
            self.transport.write(_raw_error(503, error))
            self.transport.close()

        def _reject(self) -> None:
            self._reading_head, self._head_bytes = False, 0
            self._disarm()
            if self.transport.is_closing():
                return
            error = ApiError(
                431,
                f"the request line and headers are larger than {max_head} bytes",
                code="headers_too_large",
            )
            log.warning(
                "closed a connection from %s: request head over %d bytes", self.client, max_head
            )
            metrics.observer.rejected("headers_too_large")
            self.transport.write(_raw_error(431, error))
            self.transport.close()

    return BoundedProtocol
