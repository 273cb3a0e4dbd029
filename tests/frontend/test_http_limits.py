"""The request-head bound: a huge header is answered 431 before the app (and its key check)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from tests.frontend.conftest import served

LIMIT = 16 * 1024


@pytest.fixture
def server_port(make_config, engine) -> Iterator[int]:
    with served(make_config(api_key="sekrit", max_head_bytes=LIMIT), engine) as port:
        yield port


def _request(port: int, head: bytes, filler: int, chunk: int = 8192) -> tuple[bytes, int]:
    """Sends `head`, then `filler` bytes of one header's value, then ends the head; returns
    the reply and how many filler bytes the server took before it closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head)
        sent = 0
        try:
            while sent < filler:
                s.sendall(b"a" * chunk)
                sent += chunk
            s.sendall(b"\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = b""
        try:
            while data := s.recv(65536):
                reply += data
        except ConnectionResetError:
            pass
    return reply, sent


def test_huge_header_is_431_before_the_key_check(server_port: int) -> None:
    head = b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-filler: "
    reply, sent = _request(server_port, head, filler=4 * 2**20)
    assert reply.startswith(b"HTTP/1.1 431 "), reply[:200]
    assert b'"code":"headers_too_large"' in reply
    assert sent < 4 * 2**20, "the server stopped reading long before the head ended"


def test_head_within_the_limit_reaches_the_app(server_port: int) -> None:
    head = b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\nx-filler: "
    reply, _ = _request(server_port, head, filler=LIMIT // 2, chunk=1024)
    assert reply.startswith(b"HTTP/1.1 401 "), reply[:200]  # the app's key check answered
