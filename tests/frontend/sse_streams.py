"""Live streaming requests on the real frontend, for the fan-out + SSE benchmark and its profile.

`LiveStreams(n)` serves the app through uvicorn's httptools protocol (the frontend's own
protocol class) on a loopback TCP listener, opens n streaming requests from plain sockets and
holds them open; `step()` hands the engine client one TextDeltas frame (a delta for every
stream, msgpack-decoded as the listener would) and returns once every stream's SSE event has
been written to its socket. What runs is the frontend's real path: dispatch, each stream's
queue and handler, chunk JSON, the Responder, uvicorn's chunked body write, the transport.

`python -m tests.frontend.sse_streams [N] [STEPS]` runs N streams for STEPS steps and prints
the time per step, for py-spy.
"""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import sys
import time

import msgspec
import tokenizers
import uvicorn
from prometheus_client import CollectorRegistry
from uvicorn.server import ServerState

from gapless.common.config import EngineConfig
from gapless.common.messages import AddRequest, CoreInput, FrontendInput, TextDelta, TextDeltas
from gapless.common.metrics import FrontendMetrics
from gapless.frontend.api.prompts import Prompter
from gapless.frontend.api.state import FrontendState
from gapless.frontend.app import App
from gapless.frontend.engine.admission import Admission
from gapless.frontend.engine.client import EngineClient
from gapless.frontend.http import metrics
from gapless.frontend.http.transport import bounded_protocol

TEXT = " word"  # every delta's text: one token
TOKEN = 1801


class _Counting(metrics.PrometheusObserver):
    """The served frontend's observer, also counting written events for the step's end."""

    def __init__(self) -> None:
        super().__init__(FrontendMetrics(CollectorRegistry()))
        self.expected = 0
        self.written = 0
        self.done: asyncio.Future[None] | None = None

    def streamed(self, seconds: float) -> None:
        super().streamed(seconds)
        self.written += 1
        if self.written == self.expected and self.done is not None:
            self.done.set_result(None)


class LiveStreams:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: tokenizers.Tokenizer,
        num_streams: int,
        endpoint: str = "chat",
    ) -> None:
        self.config = config
        self.num_streams = num_streams
        self.endpoint = endpoint
        self.added: list[AddRequest] = []
        self.engine = EngineClient(0, self._from_frontend)
        prompter = Prompter(tokenizer, config)
        state = FrontendState(config, self.engine, prompter, Admission(config, self.engine))
        self.app = App(state)
        self.observer = _Counting()
        self.decoder = msgspec.msgpack.Decoder(FrontendInput)
        self.clients: list[socket.socket] = []
        self.received: list[bytearray] = []
        self.num_steps = 0
        self.events: list[str] = []  # the text each stream's events carry, in order
        self._server: asyncio.Server | None = None

    def _from_frontend(self, msg: CoreInput) -> None:
        if isinstance(msg, AddRequest):
            self.added.append(msg)

    def _request(self) -> bytes:
        if self.endpoint == "chat":
            path = "/v1/chat/completions"
            body = {"messages": [{"role": "user", "content": "hi"}]}
        else:
            path = "/v1/completions"
            body = {"prompt": "hi"}
        body |= {"model": self.config.served_model_name, "stream": True, "max_tokens": 100}
        payload = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\n\r\n"
        )
        return head.encode() + payload

    async def open(self) -> None:
        """Listen, connect every client, send its request; return once the engine has them all."""
        metrics.set_observer(self.observer)
        loop = asyncio.get_running_loop()
        uv_config = uvicorn.Config(
            self.app,
            http=bounded_protocol(self.config),
            lifespan="off",
            log_level="critical",
        )
        uv_config.load()
        state = ServerState()
        protocol = uv_config.http_protocol_class
        self._server = await loop.create_server(
            lambda: protocol(config=uv_config, server_state=state, app_state={}, _loop=loop),
            "127.0.0.1",
            0,
        )
        port = self._server.sockets[0].getsockname()[1]
        request = self._request()
        for _ in range(self.num_streams):
            sock = socket.socket()
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", port))
            await loop.sock_sendall(sock, request)
            self.clients.append(sock)
            self.received.append(bytearray())
        deadline = time.monotonic() + 30
        while len(self.added) < self.num_streams:
            assert time.monotonic() < deadline, f"{len(self.added)} of {self.num_streams} started"
            await asyncio.sleep(0.001)
        gc.collect()  # as the served frontend does once started (frontend/server.py)
        gc.freeze()

    def frame(self) -> bytes:
        """One step's TextDeltas for every stream, as the listener receives it."""
        self.num_steps += 1
        deltas = [TextDelta(add.request_id, TEXT, [TOKEN], 1, self.num_steps) for add in self.added]
        return msgspec.msgpack.encode(TextDeltas(deltas))

    async def step(self, frame: bytes) -> bool:
        """Dispatch one frame; return once every stream has written its event: True if all
        were written while dispatching (by the listener, no handler woken)."""
        return await self.burst([frame])

    async def burst(self, frames: list[bytes]) -> bool:
        """Dispatch frames as the listener does a burst of frames that waited (held, then
        flushed once); return as `step`, each stream having written them as one event."""
        observer = self.observer
        observer.written = 0
        observer.expected = self.num_streams
        observer.done = asyncio.get_running_loop().create_future()
        for i, frame in enumerate(frames):
            self.engine.dispatch(self.decoder.decode(frame), flush=i == len(frames) - 1)
        self.events.append(TEXT * len(frames))
        at_once = observer.done.done()
        await observer.done
        return at_once

    def drain(self) -> None:
        """Read what the clients were sent so far (kept for `check`)."""
        for sock, got in zip(self.clients, self.received, strict=True):
            while True:
                try:
                    data = sock.recv(1 << 20)
                except BlockingIOError:
                    break
                if not data:
                    break
                got += data

    def check(self) -> None:
        """Every client got one event per step or burst, in order, carrying its text."""
        self.drain()
        field = b'"content":' if self.endpoint == "chat" else b'"text":'
        for got in self.received:
            assert got.startswith(b"HTTP/1.1 200 OK"), bytes(got[:200])
            events = [e for e in bytes(got).split(b"\r\n") if e.startswith(b"data: ")]
            texts = [json.loads(e[6:]) for e in events]
            if self.endpoint == "chat":
                assert texts[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
                texts = texts[1:]
            assert all(field in e for e in events[-1:])
            key = "delta" if self.endpoint == "chat" else None
            got = [
                t["choices"][0][key]["content"] if key else t["choices"][0]["text"] for t in texts
            ]
            assert got == self.events

    async def close(self) -> None:
        for sock in self.clients:
            sock.close()
        if self._server is not None:
            self._server.close()
        # the handlers see their clients gone and abort; give them a turn
        for _ in range(10):
            await asyncio.sleep(0)
        metrics.set_observer(metrics.RequestObserver())
        gc.unfreeze()


def _main() -> None:  # pragma: no cover - a profiling entry
    import uvloop

    from gapless.common.config import ModelInfo
    from gapless.common.model_cache import default_model_path
    from gapless.common.model_files import load_tokenizer, resolve_model

    num_streams = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    num_steps = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    info: ModelInfo = resolve_model(str(default_model_path()))
    config = EngineConfig(model=info, served_model_name="m", stream_buffer_events=1 << 20)
    loop = uvloop.new_event_loop()
    streams = LiveStreams(config, load_tokenizer(info), num_streams)
    loop.run_until_complete(streams.open())
    times, cpu = [], 0.0
    for _ in range(num_steps):
        frame = streams.frame()
        start, start_cpu = time.perf_counter(), time.process_time()
        loop.run_until_complete(streams.step(frame))
        cpu += time.process_time() - start_cpu
        times.append(time.perf_counter() - start)
        streams.drain()
    times.sort()
    print(f"{num_streams} streams: median {times[len(times) // 2] * 1e6:.0f} us per step, "
          f"min {times[0] * 1e6:.0f} us, CPU {cpu / num_steps * 1e6:.0f} us")  # fmt: skip
    loop.run_until_complete(streams.close())


if __name__ == "__main__":
    _main()
