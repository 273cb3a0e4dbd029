"""A small OpenAI-compatible server with canned streams and no engine timeline, run in a thread."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import uvicorn

from tests.server import free_port


class FakeOpenAI:
    """ASGI app: /v1/models, /health and streaming /v1/completions of `max_tokens` chunks.
    `failures` maps the 0-based request number to "http" (a 500), "event" (an error event
    mid-stream) or "broken" (the stream ends without [DONE]). `bodies` and `headers` (names
    lower-cased) keep each completion request as received."""

    def __init__(self, failures: dict[int, str] | None = None, delay_s: float = 0.002) -> None:
        self.failures = failures or {}
        self.delay_s = delay_s
        self.num_requests = 0
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path == "/v1/models" and method == "GET":
            await self._json(send, 200, {"object": "list", "data": [{"id": "fake-model"}]})
        elif path == "/health":
            await self._json(send, 200, {"status": "ok"})
        elif path == "/v1/completions" and method == "POST":
            body = b""
            while True:
                msg = await receive()
                body += msg.get("body", b"")
                if not msg.get("more_body"):
                    break
            self.headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
            await self._complete(send, json.loads(body))
        else:
            await self._json(send, 404, {"error": {"message": "not found"}})

    async def _json(self, send: Any, status: int, doc: Any) -> None:
        payload = json.dumps(doc).encode()
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})

    async def _complete(self, send: Any, req: dict[str, Any]) -> None:
        n = self.num_requests
        self.num_requests += 1
        self.bodies.append(req)
        failure = self.failures.get(n)
        if failure == "http":
            await self._json(send, 500, {"error": {"message": "canned failure"}})
            return
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})

        async def event(doc: Any) -> None:
            data = doc if isinstance(doc, str) else json.dumps(doc)
            chunk = f"data: {data}\n\n".encode()
            await send({"type": "http.response.body", "body": chunk, "more_body": True})

        num_tokens = int(req.get("max_tokens", 16))
        for i in range(num_tokens):
            await asyncio.sleep(self.delay_s)
            if i == 1 and failure == "event":
                await event({"error": {"message": "canned error event", "code": 500}})
                break
            if i == 1 and failure == "broken":
                break
            choice = {"index": 0, "text": f" w{i}", "finish_reason": None}
            if i == num_tokens - 1:
                choice["finish_reason"] = "length"
            await event({"id": f"c{n}", "object": "text_completion", "choices": [choice]})
        else:
            if (req.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": 1, "completion_tokens": num_tokens}
                await event({"id": f"c{n}", "choices": [], "usage": usage})
        if failure != "broken":
            await event("[DONE]")
        await send({"type": "http.response.body", "body": b""})


class ThreadedServer:
    """uvicorn serving `app` on a free 127.0.0.1 port from a daemon thread."""

    def __init__(self, app: Any) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "fake server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
