"""Connections bounded in time and number (frontend/http/transport.py, `bounded_protocol`): idle, slow-head
and slow-body connections are closed at their deadlines, past --max-connections the longest-idle
one makes room, /health answers when none is idle, and keep-alive outlasts the clients' reuse.

Every deadline here is short (0.5 s) and checked with a margin of 5 s; none checks how fast the
machine is."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack

import aiohttp
import httpx
import pytest

from gapless.common.config import EngineConfig
from gapless.frontend.http.transport import OVER_CAP_HEAD_S, connection_cap
from tests.frontend.conftest import served

DEADLINE_S = 0.5
MARGIN_S = 5.0
CAP = 8
COMPLETION = {"model": "smol-test", "prompt": "hi", "max_tokens": 2}


@pytest.fixture
def port(make_config, engine) -> Iterator[int]:
    config = make_config(header_timeout_s=DEADLINE_S, body_timeout_s=DEADLINE_S,
                         max_connections=CAP)  # fmt: skip
    with served(config, engine) as port:
        yield port


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=MARGIN_S + 5)


def _until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """What the server sent until it closed, and the seconds that took."""
    start, got = time.monotonic(), b""
    try:
        while data := sock.recv(65536):
            got += data
    except ConnectionResetError:
        pass
    return got, time.monotonic() - start


def _response(sock: socket.socket) -> bytes:
    """One whole response with a content-length, leaving the connection open."""
    got = b""
    while b"\r\n\r\n" not in got:
        got += sock.recv(65536)
    head, _, body = got.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def _get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode()


def test_an_idle_connection_is_closed_without_a_word_at_the_header_timeout(port: int) -> None:
    with _connect(port) as s:
        got, took = _until_closed(s)
    assert got == b"", got
    assert 0.8 * DEADLINE_S <= took < DEADLINE_S + MARGIN_S, took


def test_a_head_sent_a_byte_at_a_time_gets_408_at_the_header_timeout(port: int) -> None:
    with _connect(port) as s:
        start = time.monotonic()
        s.sendall(b"GET /health HTTP/1.1\r\nx-slow: ")
        try:
            while time.monotonic() - start < DEADLINE_S + MARGIN_S:
                s.sendall(b"a")
                time.sleep(0.05)
        except (BrokenPipeError, ConnectionResetError):
            pass
        got, _ = _until_closed(s)
        took = time.monotonic() - start
    assert got.startswith(b"HTTP/1.1 408 "), got[:200]
    assert b'"code":"request_timeout"' in got
    assert took < DEADLINE_S + MARGIN_S, took


def test_a_body_that_stops_gets_408_at_the_body_timeout(port: int) -> None:
    with _connect(port) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                  b"\r\ncontent-length: 1000000\r\n\r\n0123456789")  # fmt: skip
        got, took = _until_closed(s)
    assert got.startswith(b"HTTP/1.1 408 "), got[:200]
    assert b"bytes/s" in got
    # 10 bytes bought 10 / 500 s more
    assert 0.8 * DEADLINE_S <= took < DEADLINE_S + MARGIN_S, took


def test_a_body_that_keeps_the_minimum_rate_is_read_whole(make_config, engine) -> None:
    """0.5 s for the body, then 100 kB/s: 60 kB sent over ~0.6 s keeps well above it."""
    config = make_config(body_timeout_s=DEADLINE_S, body_min_rate=100_000)
    body = json.dumps(COMPLETION).encode()
    body += b" " * (60_000 - len(body))
    with served(config, engine) as port, _connect(port) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                  b"\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % len(body))  # fmt: skip
        for i in range(0, len(body), 10_000):
            s.sendall(body[i : i + 10_000])
            time.sleep(0.1)
        got, _ = _until_closed(s)
    assert got.startswith(b"HTTP/1.1 200 "), got[:300]


def test_past_the_cap_the_longest_idle_connection_makes_room(port: int) -> None:
    with ExitStack() as stack:
        held = [stack.enter_context(_connect(port)) for _ in range(CAP)]
        time.sleep(0.1)
        # a new connection closes the oldest idle one and is served
        r = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=MARGIN_S)
        assert r.status_code == 200, r.text
        got, took = _until_closed(held[0])
        assert got == b"" and took < DEADLINE_S, took


def test_with_none_idle_health_still_answers_and_the_rest_is_503(port: int, make_config) -> None:
    _, reserve = connection_cap(make_config(max_connections=CAP))
    with ExitStack() as stack:
        for _ in range(CAP):  # not idle: each has begun a head (within its 0.5 s)
            stack.enter_context(_connect(port)).sendall(b"G")
        time.sleep(0.1)
        health = _one(port, _get("/health"))
        assert health.startswith(b"HTTP/1.1 200 "), health[:200]
        busy = _one(port, _get("/v1/models"))
        assert busy.startswith(b"HTTP/1.1 503 "), busy[:200]
        assert b'"code":"too_many_connections"' in busy
        for _ in range(CAP):  # refresh them: their 0.5 s are nearly up
            stack.enter_context(_connect(port)).sendall(b"G")
        over = [stack.enter_context(_connect(port)) for _ in range(reserve)]
        time.sleep(0.1)
        refused = _one(port, b"")  # past the reserve: a 503 at once, before any request
        assert refused.startswith(b"HTTP/1.1 503 "), refused[:200]
        got, took = _until_closed(over[-1])
        assert took < OVER_CAP_HEAD_S + MARGIN_S


def test_a_client_is_served_beside_hundreds_of_idle_connections(port: int) -> None:
    with ExitStack() as stack:
        for _ in range(300):
            stack.enter_context(_connect(port))
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=MARGIN_S) as client:
            for _ in range(10):
                assert client.get("/health").status_code == 200
                assert client.post("/v1/completions", json=COMPLETION).status_code == 200


def test_a_request_on_a_connection_idle_past_the_keep_alive_fails(make_config, engine) -> None:
    """What a client sees when the server closes a keep-alive connection as the client reuses
    it: no answer (a read error). Hence --keep-alive-timeout outlasts the clients' reuse."""
    with served(make_config(keep_alive_timeout_s=DEADLINE_S), engine) as port:
        with _connect(port) as s:
            s.sendall(_get("/health"))
            assert _response(s).startswith(b"HTTP/1.1 200 ")
            time.sleep(DEADLINE_S + 0.3)
            try:
                s.sendall(_get("/health"))
                got, _ = _until_closed(s)
            except (BrokenPipeError, ConnectionResetError):
                got = b""
            assert got == b"", got[:200]


def test_keep_alive_outlasts_the_idle_reuse_of_common_clients() -> None:
    async def aiohttp_reuse() -> float:
        connector = aiohttp.TCPConnector()
        try:
            return connector._keepalive_timeout  # the default it reuses a connection for
        finally:
            await connector.close()

    reuse = {"httpx": httpx.Limits().keepalive_expiry, "aiohttp": asyncio.run(aiohttp_reuse())}
    default = EngineConfig.__struct_defaults__[EngineConfig.__struct_fields__.index(
        "keep_alive_timeout_s")]  # fmt: skip
    assert default > max(reuse.values()), (default, reuse)


def _one(port: int, request: bytes) -> bytes:
    with _connect(port) as s:
        if request:
            s.sendall(request)
        got, _ = _until_closed(s)
    return got
