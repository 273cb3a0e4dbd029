"""Benchmark: one step's deltas fanned out to 256 live streams and written as SSE bytes.

Skipped as a timing unless run with `--benchmark-enable`:
`pytest tests/frontend/test_bench_sse.py --benchmark-enable`. The target at 256 streams is
300 us per step on a quiet machine (docs/architecture.md, "The host floor").
"""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from tests.frontend.sse_streams import LiveStreams


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("num_streams", [64, 256])
def test_bench_fanout_sse_step(benchmark, make_config, hf_tokenizer, num_streams, endpoint):
    config = make_config()
    loop = uvloop.new_event_loop()
    streams = LiveStreams(config, hf_tokenizer[0], num_streams, endpoint)
    try:
        loop.run_until_complete(streams.open())
        frames: list[bytes] = []

        def setup():
            streams.drain()
            frames.append(streams.frame())
            return (frames[-1],), {}

        def step(frame: bytes) -> None:
            loop.run_until_complete(streams.step(frame))

        benchmark.group = f"fan-out + SSE, {num_streams} streams"
        benchmark.pedantic(step, setup=setup, rounds=100, warmup_rounds=3)
        streams.check()
    finally:
        loop.run_until_complete(streams.close())
        loop.close()
        asyncio.set_event_loop(None)
