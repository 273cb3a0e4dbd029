"""Disconnects, engine death and engine-side failures, driving the ASGI app directly."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import pytest

from gapless.frontend.app import App
from tests.frontend.conftest import sse_events
from tests.frontend.fake_engine import FakeEngine

pytestmark = pytest.mark.anyio


class Call:
    """One request to the app: the body, then nothing until `disconnect()`."""

    def __init__(
        self, app: App, path: str, body: dict[str, Any], request_id: str | None = None
    ) -> None:
        self._pending = [{"type": "http.request", "body": json.dumps(body).encode()}]
        self._gone = asyncio.Event()
        self.sent: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        headers = [] if request_id is None else [(b"x-request-id", request_id.encode())]
        scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
        self.task = asyncio.ensure_future(app(scope, self._receive, self.sent.put))

    async def _receive(self) -> dict[str, Any]:
        if self._pending:
            return self._pending.pop(0)
        await self._gone.wait()
        return {"type": "http.disconnect"}

    def disconnect(self) -> None:
        self._gone.set()

    async def next_body(self) -> bytes:
        while True:
            message = await asyncio.wait_for(self.sent.get(), 2)
            if message["type"] == "http.response.body":
                return message["body"]


async def _eventually(cond, timeout_s: float = 1.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("stream", [True, False])
async def test_disconnect_aborts_every_choice(app: App, engine: FakeEngine, stream: bool) -> None:
    engine.gate = asyncio.Event()  # deltas stop after the first
    body = {"prompt": "a b c d", "max_tokens": 4, "n": 2, "stream": stream}
    call = Call(app, "/v1/completions", body)
    if stream:
        assert b"data: " in await call.next_body()
    else:
        await _eventually(lambda: len(engine.added) == 2)
    call.disconnect()
    await asyncio.wait_for(call.task, 1)
    ids = sorted(a.request_id for a in engine.added)
    assert sorted(engine.aborted) == ids
    assert engine.num_in_flight == 0


async def test_finished_request_sends_no_abort(client: httpx.AsyncClient, engine) -> None:
    r = await client.post("/v1/completions", json={"prompt": "a b", "max_tokens": 2, "n": 2})
    assert r.status_code == 200
    assert engine.aborted == [] and engine.num_in_flight == 0


async def test_engine_death_mid_stream(app: App, engine: FakeEngine, client) -> None:
    engine.gate = asyncio.Event()
    call = Call(
        app,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a b"}], "stream": True},
    )
    await call.next_body()  # the role chunk
    engine.die("core crashed")
    await asyncio.wait_for(call.task, 1)
    rest = b""
    while not call.sent.empty():
        rest += (await call.sent.get()).get("body", b"")
    events = sse_events(rest.decode())
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert "core crashed" in error["message"] and error["code"] == "engine_unavailable"

    r = await client.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "dead"
    r = await client.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    r = await client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
    )
    assert r.status_code == 503


@pytest.mark.parametrize("stream", [True, False])
async def test_engine_death_before_first_token(app: App, engine: FakeEngine, stream) -> None:
    engine.delay_s = 10
    call = Call(app, "/v1/completions", {"prompt": "a", "stream": stream})
    await _eventually(lambda: engine.num_in_flight == 1)
    engine.die("gone")
    await asyncio.wait_for(call.task, 1)
    start = await call.sent.get()
    assert start["status"] == 503  # nothing was streamed yet: a real status


@pytest.mark.parametrize(("finish", "status"), [("error", 500), ("abort", 503)])
async def test_engine_failure_of_one_request(client, engine: FakeEngine, finish, status) -> None:
    engine.finish_with = finish
    chat = {"messages": [{"role": "user", "content": "x y z"}], "stream": True}
    for path, body in (("/v1/completions", {"prompt": "a b"}), ("/v1/chat/completions", chat)):
        r = await client.post(path, json=body)
        assert r.status_code == status
        error = r.json()["error"]
        assert error["type"] == "server_error"
        if finish == "error":
            assert "fake failure" in error["message"]

    engine.fail_at = 1  # after one delta went out: the stream ends with an error event
    r = await client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error"
    assert events[1]["choices"][0]["delta"]["content"] == "system"  # ChatML adds one
    assert (await client.get("/health")).status_code == 200  # one request, not the engine


async def test_a_drain_cut_ends_streams_with_abort_and_logs_their_ids(
    app: App, engine: FakeEngine, caplog
) -> None:
    """The drain's cut: each stream's choices end with finish_reason abort, then an error
    event; the access line says abort; the log line names the requests it ended."""
    import uvicorn

    from gapless.frontend.server import _Server

    caplog.set_level(logging.INFO)
    engine.gate = asyncio.Event()  # deltas stop after the first
    calls = [
        Call(app, "/v1/completions", {"prompt": "a b c", "max_tokens": 3, "stream": True}, rid)
        for rid in ("drained-1", "drained-2")
    ]
    for call in calls:
        assert b"data: " in await call.next_body()
    server = _Server(uvicorn.Config(app), app.state.admission, engine, 0.5)  # type: ignore[arg-type]
    server.cut()
    for call in calls:
        await asyncio.wait_for(call.task, 1)
    rest = b""
    while not calls[0].sent.empty():
        rest += (await calls[0].sent.get()).get("body", b"")
    events = sse_events(rest.decode())
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "drain_timeout"
    assert events[-3]["choices"][0]["finish_reason"] == "abort"
    access = [r.fields for r in caplog.records if r.name == "gapless.access"]
    # the two streams end in whichever order the loop runs them
    assert sorted((a["request_id"], a["finish_reason"]) for a in access) == [
        ("drained-1", "abort"),
        ("drained-2", "abort"),
    ]
    cut = [r.getMessage() for r in caplog.records if "drain timeout" in r.getMessage()]
    assert cut == ["drain timeout: ended 2 request(s) still in flight: drained-1, drained-2"]


def test_a_long_list_of_ids_is_bounded() -> None:
    from gapless.frontend.server import listed

    names = [f"r{i}" for i in range(60)]
    assert listed(names) == ", ".join(names[:50]) + " and 10 more"
    assert listed(names[:50]) == ", ".join(names[:50])
