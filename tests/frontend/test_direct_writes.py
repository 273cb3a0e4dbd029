"""The usual SSE event of a stream (text only, its choice going on) is written by the engine
client's listener while the stream's handler waits, byte for byte what the handler writes; the
first event, the last and any the connection cannot take at once go through the handler. A
burst of frames that waited goes out as one event per stream, also from the listener."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import uvloop

from gapless.frontend.http.transport import chunk_writer
from tests.frontend.sse_streams import LiveStreams


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_usual_events_are_written_without_waking_a_handler(make_config, hf_tokenizer, endpoint):
    loop = uvloop.new_event_loop()
    streams = LiveStreams(make_config(), hf_tokenizer[0], 16, endpoint)
    try:
        loop.run_until_complete(streams.open())
        at_once = [loop.run_until_complete(streams.step(streams.frame())) for _ in range(6)]
        assert at_once == [False] + [True] * 5, "the first token's event is the handler's"
        for size in (3, 1, 5):
            frames = [streams.frame() for _ in range(size)]
            assert loop.run_until_complete(streams.burst(frames)), "joined by the listener"
        streams.check()  # every event, in order, as the handlers would have written it
    finally:
        loop.run_until_complete(streams.close())
        loop.close()
        asyncio.set_event_loop(None)


class _Transport:
    def __init__(self) -> None:
        self.closing = False
        self.written: list[bytes] = []

    def is_closing(self) -> bool:
        return self.closing

    def write(self, data: bytes) -> None:
        self.written.append(data)


def test_the_chunk_writer_writes_only_what_needs_no_wait():
    transport = _Transport()
    cycle = SimpleNamespace(
        transport=transport,
        flow=SimpleNamespace(write_paused=False),
        disconnected=False,
        response_started=True,
        response_complete=False,
        chunked_encoding=True,
    )
    write = chunk_writer(cycle)  # type: ignore[arg-type]
    assert write(b"data: x\n\n") and transport.written == [b"9\r\ndata: x\n\n\r\n"]
    assert not write(b""), "an empty chunk would end the body"
    for field, value in [
        ("disconnected", True),
        ("response_started", False),
        ("response_complete", True),
        ("chunked_encoding", False),
    ]:
        setattr(cycle, field, value)
        assert not write(b"y"), field
        setattr(cycle, field, not value)
    cycle.flow.write_paused = True  # the client reads slower than we write: the handler waits
    assert not write(b"y")
    cycle.flow.write_paused = False
    transport.closing = True  # lost, though uvicorn marked only its current cycle
    assert not write(b"y")
    assert len(transport.written) == 1
