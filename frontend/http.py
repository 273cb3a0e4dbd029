"""uvicorn's httptools protocol with a bound on the request head (request line and headers).

httptools collects a header's value in full before any callback sees it, so the bound is kept
on the bytes read while a head is incomplete: past `max_head_bytes` the connection gets a 431
and is closed at once, before the app (and its API-key check) runs and before reading more.
"""

from __future__ import annotations

import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gapless.frontend import metrics
from gapless.frontend.asgi import encoder
from gapless.frontend.errors import ApiError

log = logging.getLogger("gapless.frontend")


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
