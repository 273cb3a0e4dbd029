"""A client that stops reading its stream is aborted (its engine request too) on the unsent
buffer's cap or on the write timeout; a quiet stream gets SSE keep-alive comments."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry

from tests.frontend.conftest import build_app, served

LONG_CONTEXT = {"max_model_len": 1_000_000}
SEND_BUFFER = 32 * 1024  # the connection's, so a client that stops reading is behind at once
BODY = {"prompt": "word " * 20_000, "max_tokens": 200_000, "stream": True}
# with logprobs every chunk goes through the stream's handler; without, the engine client's
# listener writes the usual chunks itself until the connection asks it to pause
BODIES = pytest.mark.parametrize("body", [BODY | {"logprobs": 5}, BODY], ids=["logprobs", "plain"])


def _stop_reading(port: int, body_fields: dict) -> socket.socket:
    """Sends a streaming request and reads nothing of the answer."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    body = json.dumps(body_fields).encode()
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    return s


def _wait_aborted(engine, timeout_s: float) -> float:
    t0 = time.monotonic()
    while not engine.aborted:
        assert time.monotonic() - t0 < timeout_s, "the slow reader's request was not aborted"
        time.sleep(0.05)
    return time.monotonic() - t0


def _slow(registry: CollectorRegistry, reason: str) -> float:
    return registry.get_sample_value("gapless_slow_clients_total", {"reason": reason}) or 0.0


@BODIES
def test_unread_buffer_cap_aborts_the_request(make_config, engine, registry, body) -> None:
    config = make_config(model_overrides=LONG_CONTEXT, stream_write_timeout_s=600.0)
    engine.max_pending = 64
    with served(config, engine, send_buffer=SEND_BUFFER) as port:
        client = _stop_reading(port, body)
        _wait_aborted(engine, 30)
        assert engine.aborted == [engine.added[0].request_id]
        client.close()
        deadline = time.monotonic() + 5
        while engine.num_in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
    assert _slow(registry, "buffer") == 1
    assert engine.num_in_flight == 0


@BODIES
def test_write_timeout_aborts_the_request(make_config, engine, registry, body) -> None:
    config = make_config(model_overrides=LONG_CONTEXT, stream_write_timeout_s=1.0)
    engine.max_pending = 10**9
    engine.delay_s = 0.001
    with served(config, engine, send_buffer=SEND_BUFFER) as port:
        client = _stop_reading(port, body)
        _wait_aborted(engine, 30)
        assert engine.aborted == [engine.added[0].request_id]
        assert engine.num_in_flight == 0, "the request's queue is gone: nothing grows"
        client.close()
    assert _slow(registry, "write_timeout") == 1


pytestmark = pytest.mark.anyio


async def test_keepalive_comments_while_a_request_waits(make_config, engine) -> None:
    config = make_config(sse_keepalive_s=0.1)
    engine.hold = asyncio.Event()
    app = build_app(config, engine)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        asyncio.get_running_loop().call_later(0.5, engine.hold.set)
        r = await client.post(
            "/v1/completions", json={"prompt": "hi there", "max_tokens": 2, "stream": True}
        )
    blocks = [b for b in r.text.split("\n\n") if b]
    first_data = next(i for i, b in enumerate(blocks) if b.startswith("data: "))
    assert first_data >= 3 and all(b == ": keep-alive" for b in blocks[:first_data]), blocks
    assert blocks[-1] == "data: [DONE]"
