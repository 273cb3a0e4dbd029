"""A client that stops reading its stream is cut (its engine request aborted) by what it has
not taken off the socket: past --stream-buffer-events events unsent, or when it took nothing
for --stream-write-timeout; the kernel's own send buffer hides nothing. A client that reads is
never cut, however far its handler falls behind. A cut stream ends with an error event and
[DONE]; a quiet stream gets SSE keep-alive comments."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gapless.common.messages import AddRequest, TextDelta, TextDeltas
from gapless.frontend.http import transport as http
from tests.frontend.conftest import build_app, served
from tests.frontend.fake_engine import FakeEngine
from tests.timing import late_limit_s

LONG_CONTEXT = {"max_model_len": 1_000_000}
SEND_BUFFER = 32 * 1024  # the connection's, so a client that stops reading is behind at once
BODY = {"prompt": "word " * 20_000, "max_tokens": 200_000, "stream": True}
# with logprobs every chunk goes through the stream's handler; without, the engine client's
# listener writes the usual chunks itself until the connection asks it to pause
BODIES = pytest.mark.parametrize("body", [BODY | {"logprobs": 5}, BODY], ids=["logprobs", "plain"])
# a stream's end once it was cut: its error event, [DONE], the chunked body's last chunk
CUT_END = b"data: [DONE]\n\n\r\n0\r\n\r\n"


def _stop_reading(
    port: int, body_fields: dict, rcvbuf: int = 4096, path: bytes = b"/v1/completions"
) -> socket.socket:
    """Sends a streaming request and reads nothing of the answer."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    body = json.dumps(body_fields).encode()
    s.sendall(
        b"POST " + path + b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    return s


def _read_to_end(s: socket.socket, timeout_s: float = 10.0) -> bytes:
    s.settimeout(timeout_s)
    data = []
    while chunk := s.recv(1 << 16):
        data.append(chunk)
    return b"".join(data)


def _cut_error(reply: bytes) -> dict:
    """The error event a cut stream ends with, checked to be followed only by [DONE]."""
    assert reply.endswith(CUT_END), reply[-300:]
    body = reply[: -len(CUT_END)].rstrip(b"\r\n")
    last = body[body.rindex(b"data: ") :]
    return json.loads(last[len(b"data: ") :])["error"]


def _wait_aborted(engine, timeout_s: float, count: int = 1) -> float:
    t0 = time.monotonic()
    while len(engine.aborted) < count:
        assert time.monotonic() - t0 < timeout_s, "the slow reader's request was not aborted"
        time.sleep(0.05)
    return time.monotonic() - t0


def _slow(registry: CollectorRegistry, reason: str) -> float:
    return registry.get_sample_value("gapless_slow_clients_total", {"reason": reason}) or 0.0


@BODIES
def test_unread_buffer_cap_aborts_the_request(make_config, engine, registry, body) -> None:
    config = make_config(
        model_overrides=LONG_CONTEXT, stream_write_timeout_s=600.0, stream_buffer_events=64
    )
    with served(config, engine, send_buffer=SEND_BUFFER) as port:
        client = _stop_reading(port, body)
        _wait_aborted(engine, 30)
        assert engine.aborted == [engine.added[0].request_id]
        error = _cut_error(_read_to_end(client))
        assert error["code"] == "slow_reader" and "64 events" in error["message"]
        client.close()
        deadline = time.monotonic() + 5
        while engine.num_in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
    assert _slow(registry, "buffer") == 1
    assert engine.num_in_flight == 0


def test_a_cut_responses_stream_ends_with_its_own_typed_events(make_config, engine, registry):
    """/v1/responses numbers its events and sends no [DONE]: a reader cut off gets `error`
    and `response.failed`, the last two sequence numbers, and the chunked body's end."""
    config = make_config(
        model_overrides=LONG_CONTEXT, stream_write_timeout_s=600.0, stream_buffer_events=64
    )
    body = {"input": "word " * 20_000, "max_output_tokens": 200_000, "stream": True,
            "store": False}  # fmt: skip
    with served(config, engine, send_buffer=SEND_BUFFER) as port:
        client = _stop_reading(port, body, path=b"/v1/responses")
        _wait_aborted(engine, 30)
        reply = _read_to_end(client)
        client.close()
    assert reply.endswith(b"\n\n\r\n0\r\n\r\n") and b"[DONE]" not in reply, reply[-300:]
    frames = reply[: -len(b"\r\n0\r\n\r\n")].rstrip(b"\r\n").split(b"\n\n")
    error, failed = (json.loads(f[f.index(b"data: ") + 6 :]) for f in frames[-2:])
    assert error["type"] == "error" and error["code"] == "slow_reader"
    assert failed["type"] == "response.failed"
    assert failed["response"]["status"] == "failed"
    assert failed["sequence_number"] == error["sequence_number"] + 1
    assert _slow(registry, "buffer") == 1


@BODIES
def test_write_timeout_aborts_the_request(make_config, engine, registry, body, caplog) -> None:
    caplog.set_level(logging.INFO, logger="gapless.access")
    # why the event bound so high: only the timeout may cut here, however slow the machine
    config = make_config(
        model_overrides=LONG_CONTEXT, stream_write_timeout_s=1.0, stream_buffer_events=10**7
    )
    engine.delay_s = 0.001
    with served(config, engine, send_buffer=SEND_BUFFER) as port:
        client = _stop_reading(port, body)
        _wait_aborted(engine, 30)
        assert engine.aborted == [engine.added[0].request_id]
        assert engine.num_in_flight == 0, "the request's queue is gone: nothing grows"
        assert _cut_error(_read_to_end(client))["code"] == "slow_reader"
        client.close()
    assert _slow(registry, "write_timeout") == 1
    access = [r.fields for r in caplog.records if r.name == "gapless.access"]
    assert [(a["status"], a["finish_reason"]) for a in access] == [(200, "abort")]


def test_the_kernel_buffer_hides_no_slow_reader(make_config, engine, registry) -> None:
    """With the kernel's own send buffer (Linux grows it to megabytes), a client that stops
    reading is still cut within the write timeout of the moment it stopped taking bytes."""
    timeout_s = 1.0
    config = make_config(
        model_overrides=LONG_CONTEXT, stream_write_timeout_s=timeout_s, stream_buffer_events=10**7
    )
    engine.delay_s = 0.002
    with served(config, engine) as port:
        client = _stop_reading(port, BODY)
        took = _wait_aborted(engine, 30)
        client.close()
    # the client's receive buffer and ours fill within a fraction of a second at this rate
    assert took < late_limit_s(timeout_s), took
    assert _slow(registry, "write_timeout") == 1


class BurstyEngine(FakeEngine):
    """Sends each request's tokens `burst` at a time in one frame, every `interval_s`: as the
    engine client's listener hands a stream the deltas of several steps when the event loop
    is too busy to run its handler between them. Never stops early: max_tokens each."""

    burst = 40
    interval_s = 0.1

    async def _answer(self, req: AddRequest) -> None:
        words = self.tokenizer.decode(req.prompt_token_ids, skip_special_tokens=True).split()
        total = req.params.max_tokens
        for start in range(0, total, self.burst):
            await asyncio.sleep(self.interval_s)
            deltas = []
            for i in range(start, min(start + self.burst, total)):
                text = (" " if i else "") + words[i % len(words)]
                finish = "length" if i + 1 == total else None
                deltas.append(TextDelta(req.request_id, text, [100 + i], 1, i + 1, finish))
            self.dispatch(TextDeltas(deltas))


def _read_all(port: int, body: dict, out: dict) -> None:
    """Reads a stream as fast as it comes; `out` gets its text, finish_reason, errors and
    what broke the connection, if something did."""
    text, finish, errors, done, broken = [], None, [], False, None
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            with client.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        continue
                    event = json.loads(line[len("data: ") :])
                    if "error" in event:
                        errors.append(event["error"])
                        continue
                    choice = event["choices"][0]
                    text.append(choice["text"])
                    finish = choice["finish_reason"] or finish
    except httpx.HTTPError as exc:
        broken = repr(exc)
    out.update(text="".join(text), finish=finish, errors=errors, done=done, broken=broken)


def test_non_readers_are_cut_while_a_reader_gets_every_token(
    make_config, hf_tokenizer, registry, monkeypatch
) -> None:
    """64 streams that never read are cut within the write timeout, each ending with an error
    event, while a client that reads, its deltas coming in bursts larger than the unsent
    bound, gets every token."""
    monkeypatch.setattr(http, "CLOSE_GRACE_S", 60.0, raising=False)  # read late below
    timeout_s, num_slow, bound = 2.0, 64, 16
    config = make_config(
        model_overrides=LONG_CONTEXT, stream_write_timeout_s=timeout_s, stream_buffer_events=bound
    )
    engine = BurstyEngine(hf_tokenizer[0])
    engine.max_pending = bound  # as the served engine client takes --stream-buffer-events
    word = "abcdefghij" * 5  # one token's text: 50 bytes, so the buffers fill fast
    slow_body = {"prompt": f"{word} " * 4, "max_tokens": 500_000, "stream": True}
    read_body = {"prompt": "one two three", "max_tokens": 2000, "stream": True}
    with served(config, engine) as port:
        t0 = time.monotonic()
        slow = [_stop_reading(port, slow_body) for _ in range(num_slow)]
        got: dict = {}
        reader = threading.Thread(target=_read_all, args=(port, read_body, got))
        reader.start()
        took = _wait_aborted(engine, 60, num_slow)
        t_cut = time.monotonic() - t0
        ends = [_cut_error(_read_to_end(s)) for s in slow]
        reader.join(60)
        for s in slow:
            s.close()
    reader_id = next(a.request_id for a in engine.added if a.params.max_tokens == 2000)
    assert reader_id not in engine.aborted and len(engine.aborted) == num_slow
    words = ["one", "two", "three"]
    assert got["text"] == " ".join(words[i % 3] for i in range(2000))
    assert got["broken"] is None and not got["errors"]
    assert got["finish"] == "length" and got["done"]
    assert all(e["code"] == "slow_reader" for e in ends)
    assert _slow(registry, "write_timeout") + _slow(registry, "buffer") == num_slow
    assert t_cut < late_limit_s(timeout_s), (took, t_cut)


class StallingEngine(FakeEngine):
    """Sends a request's tokens 40 to a frame, every 5 ms, except for one frame of 2,000 after
    which it stops the event loop itself for stall_s (as a long synchronous step would): the
    kernel's send buffer takes a part of that frame's event, the transport holds the rest
    while the loop stands still and the client empties the kernel's."""

    stall_s = 0.0

    async def _answer(self, req: AddRequest) -> None:
        words = self.tokenizer.decode(req.prompt_token_ids, skip_special_tokens=True).split()
        total, at = req.params.max_tokens, 0
        for burst in [40] * 20 + [2000] + [40] * 20:
            await asyncio.sleep(0.005)
            deltas = [
                TextDelta(req.request_id, " " + words[i % len(words)], [100 + i], 1, i + 1)
                for i in range(at, at + burst)
            ]
            at += burst
            if at == total:
                deltas[-1].finish_reason = "length"
            self.dispatch(TextDeltas(deltas))
            if burst > 40:
                time.sleep(self.stall_s)


def test_a_stalled_event_loop_cuts_no_reader(make_config, hf_tokenizer, registry) -> None:
    """The event loop stops for three write timeouts, its transport holding what the kernel
    could not take, while the client reads as fast as it can: what the transport holds is
    ours to write, not the client's to read."""
    timeout_s = 1.0
    config = make_config(
        model_overrides=LONG_CONTEXT, stream_write_timeout_s=timeout_s, stream_buffer_events=4
    )
    engine = StallingEngine(hf_tokenizer[0])
    engine.max_pending, engine.stall_s = 16, 3 * timeout_s
    word = "abcdefghij" * 40
    body = {"prompt": f"{word} " * 2, "max_tokens": 3600, "stream": True}
    got: dict = {}
    with served(config, engine) as port:
        _read_all(port, body, got)
    assert got["broken"] is None and not got["errors"], got["errors"]
    assert got["text"] == "".join([" " + word] * 3600)
    assert got["finish"] == "length" and got["done"] and not engine.aborted
    assert _slow(registry, "write_timeout") + _slow(registry, "buffer") == 0


pytestmark = pytest.mark.anyio


async def test_keepalive_comments_while_a_request_waits(make_config, engine) -> None:
    """A comment every 0.1 s while the engine holds the first token for 1 s: at least one
    comes on any machine (a loaded one runs the timers late, never out of order)."""
    config = make_config(sse_keepalive_s=0.1)
    engine.hold = asyncio.Event()
    app = build_app(config, engine)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        asyncio.get_running_loop().call_later(1.0, engine.hold.set)
        r = await client.post(
            "/v1/completions", json={"prompt": "hi there", "max_tokens": 2, "stream": True}
        )
    blocks = [b for b in r.text.split("\n\n") if b]
    first_data = next(i for i, b in enumerate(blocks) if b.startswith("data: "))
    assert first_data >= 1 and all(b == ": keep-alive" for b in blocks[:first_data]), blocks
    assert blocks[-1] == "data: [DONE]"
