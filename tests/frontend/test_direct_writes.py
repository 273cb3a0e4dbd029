"""The usual SSE event of a stream (text only, its choice going on) is written by the engine
client's listener while the stream's handler waits, byte for byte what the handler writes; the
first event, the last and any the connection cannot take at once go through the handler. A
burst of frames that waited goes out as one event per stream, also from the listener."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

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
