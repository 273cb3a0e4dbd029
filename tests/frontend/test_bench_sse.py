"""Benchmark: one step's deltas fanned out to 256 live streams and written as SSE bytes.

Skipped as a timing unless run with `--benchmark-enable`:
`pytest tests/frontend/test_bench_sse.py --benchmark-enable`. The target at 256 streams is
300 us per step on a quiet machine; bench/RESULTS.md ("SSE: the listener writes the usual
event") has what was measured, and why one write per stream per step keeps it out of reach.
"""

from __future__ import annotations

import asyncio
import socket

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


@pytest.mark.parametrize("num_streams", [64, 256])
def test_bench_socket_writes_alone(benchmark, num_streams):
    """The floor under the step above: one write of an event's size (a chat chunk, ~200 bytes
    with its chunk framing) to each of num_streams loopback TCP connections, nothing else."""
    loop = uvloop.new_event_loop()
    transports: list[asyncio.Transport] = []

    class Sink(asyncio.Protocol):
        def connection_made(self, transport):  # type: ignore[override]
            transports.append(transport)  # type: ignore[arg-type]

    async def connect() -> list[socket.socket]:
        server = await loop.create_server(Sink, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        clients = []
        for _ in range(num_streams):
            sock = socket.socket()
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", port))
            clients.append(sock)
        while len(transports) < num_streams:
            await asyncio.sleep(0.001)
        return clients

    clients = loop.run_until_complete(connect())
    event = b"c8\r\ndata: " + b"x" * 190 + b"\n\n\r\n"
    received = [0] * num_streams

    def drain():
        for i, sock in enumerate(clients):
            try:
                while data := sock.recv(1 << 20):
                    received[i] += len(data)
            except BlockingIOError:
                pass

    calls = [0]

    def write_all() -> None:
        calls[0] += 1
        for transport in transports:
            transport.write(event)

    try:
        benchmark.group = f"fan-out + SSE, {num_streams} streams"
        benchmark.pedantic(write_all, setup=drain, rounds=100, warmup_rounds=3)
        drain()
        assert set(received) == {len(event) * calls[0]}
    finally:
        for sock in clients:
            sock.close()
        for transport in transports:
            transport.close()
        loop.close()
