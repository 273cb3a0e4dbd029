from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gapless.bench.client import RequestRecord, completion_payload, stream_completion
from gapless.bench.loadgen import LoadSpec, run_load
from gapless.bench.sse import Event, SSEDecoder, SSEStream
from gapless.bench.workloads import BenchRequest, Workload
from tests.bench.fake_openai import FakeOpenAI, ThreadedServer
from tests.server import free_port


def feed_all(lines):
    d = SSEDecoder()
    events = [e for line in lines if (e := d.feed(line)) is not None]
    if (last := d.flush()) is not None:
        events.append(last)
    return events


def test_sse_decoder():
    lines = [
        ": keep-alive",
        'data: {"a": 1}',
        "",
        "event: error",
        'data:{"error": 1}',
        "",
        "data: line one",
        "data: line two\r",
        "",
        "",
        "data: [DONE]",
    ]
    assert feed_all(lines) == [
        Event('{"a": 1}'),
        Event('{"error": 1}', "error"),
        Event("line one\nline two"),
        Event("[DONE]"),
    ]


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7, 1000])
def test_sse_stream_reads_events_however_the_bytes_are_cut(cut):
    body = (
        b': keep-alive\n\ndata: {"a": 1}\n\nevent: error\ndata:{"error": 1}\r\n\r\n'
        b"data: line one\ndata: line two\r\n\n\ndata: [DONE]\n\ndata: unfinished"
    )
    stream = SSEStream()
    events = [e for i in range(0, len(body), cut) for e in stream.feed(body[i : i + cut])]
    assert events == [
        Event('{"a": 1}'),
        Event('{"error": 1}', "error"),
        Event("line one\nline two"),
        Event("[DONE]"),
    ]


def chunk(text, usage=None):
    doc = {"id": "x", "choices": [{"index": 0, "text": text}] if text is not None else []}
    if usage is not None:
        doc["usage"] = {"prompt_tokens": 3, "completion_tokens": usage}
    return f"data: {json.dumps(doc)}\n\n".encode()


def run_one(handler):
    """One stream_completion against a local aiohttp server whose POST handler is `handler`."""

    async def go():
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        async with TestServer(app) as server, aiohttp.ClientSession() as session:
            body = completion_payload("m", "hi", 4, ignore_eos=True, temperature=0.0)
            url = str(server.make_url("/v1/completions"))
            return await stream_completion(session, url, body, RequestRecord(3, 4))

    return asyncio.run(go())


def sse(parts, fail=False, seen=None):
    """A handler streaming canned body parts; `fail` drops the connection after them."""

    async def handler(request):
        if seen is not None:
            seen.append(await request.json())
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for part in parts:
            await asyncio.sleep(0.001)
            await resp.write(part)
        if fail:
            request.transport.close()
            return resp
        await resp.write_eof()
        return resp

    return handler


def test_stream_with_usage():
    seen = []
    parts = [chunk(" a"), chunk(" b"), chunk(""), chunk(" c"), chunk(None, usage=7)]
    r = run_one(sse([*parts, b"data: [DONE]\n\n"], seen=seen))
    assert r.ok and r.error is None
    assert r.output_tokens == 7  # usage wins over counting chunks
    assert r.ttft > 0 and len(r.itl) == 2 and all(x > 0 for x in r.itl)
    assert r.e2e >= r.ttft + sum(r.itl)
    body = seen[0]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 4


def test_stream_without_usage_counts_chunks():
    r = run_one(sse([chunk(" a"), chunk(" b"), chunk(" c"), b"data: [DONE]\n\n"]))
    assert r.ok and r.output_tokens == 3 and r.tpot is not None


def test_http_error_is_recorded():
    async def handler(request):
        return web.json_response({"error": {"message": "max_tokens is too large"}}, status=400)

    r = run_one(handler)
    assert not r.ok and r.error == "HTTP 400: max_tokens is too large"


def test_error_event_is_recorded():
    err = b'data: {"error": {"message": "engine died", "code": 503}}\n\n'
    r = run_one(sse([chunk(" a"), err, b"data: [DONE]\n\n"]))
    assert not r.ok and r.error == "error event: engine died"


def test_named_error_event_is_recorded():
    r = run_one(sse([chunk(" a"), b'event: error\ndata: {"detail": "x"}\n\n']))
    assert not r.ok and r.error.startswith("error event")


def test_broken_stream_is_recorded():
    r = run_one(sse([chunk(" a")], fail=True))
    assert not r.ok and r.error.startswith("ClientPayloadError")
    assert r.e2e is not None


def test_stream_without_done_is_recorded():
    r = run_one(sse([chunk(" a"), chunk(" b")]))
    assert not r.ok and r.error == "stream ended before [DONE]"


def test_garbage_event_is_recorded():
    r = run_one(sse([b"data: {not json\n\n"]))
    assert not r.ok and r.error.startswith("bad stream event")


def test_unreachable_server_is_recorded():
    async def go():
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{free_port()}/v1/completions"
            return await stream_completion(session, url, {}, RequestRecord(3, 4))

    r = asyncio.run(go())
    assert not r.ok and r.error.startswith("ClientConnectorError")


def workload(n):
    reqs = tuple(BenchRequest(f"prompt {i}", 3, 5) for i in range(n))
    return Workload("3:5", reqs, synthetic=True)


@pytest.mark.parametrize("rate,concurrency", [(float("inf"), None), (200.0, 2)])
def test_load_counts_failures_and_goes_on(rate, concurrency):
    app = FakeOpenAI(failures={1: "http", 3: "event", 5: "broken"})
    spec = LoadSpec(request_rate=rate, max_concurrency=concurrency, progress=False)
    with ThreadedServer(app) as server:
        result = asyncio.run(run_load(server.url, None, "fake-model", workload(8), spec))
    assert len(result.records) == 8 and result.duration_s > 0
    failed = sorted(r.error for r in result.records if not r.ok)
    assert len(failed) == 3
    assert any(e.startswith("HTTP 500") for e in failed)
    assert any(e.startswith("error event") for e in failed)
    assert "stream ended before [DONE]" in failed
    assert all(r.output_tokens == 5 for r in result.records if r.ok)
    assert {b["prompt"] for b in app.bodies} == {f"prompt {i}" for i in range(8)}


def test_sessions_resend_their_history_each_turn():
    app = FakeOpenAI()
    reqs = tuple(BenchRequest(f"s{s}t{t}", 1, 2, session=s) for s in range(2) for t in range(3))
    w = Workload("chat:2:3:1:2", reqs, synthetic=True, think_s=0.01)
    with ThreadedServer(app) as server:
        result = asyncio.run(run_load(server.url, None, "fake-model", w, LoadSpec(progress=False)))
    assert len(result.records) == 6 and all(r.ok for r in result.records)
    prompts = [b["prompt"] for b in app.bodies]
    # each turn: the session's last prompt, the answer's text (" w0 w1"), then the new message
    assert "s0t0 w0 w1 s0t1" in prompts and "s0t0 w0 w1 s0t1 w0 w1 s0t2" in prompts
    assert "s1t0 w0 w1 s1t1 w0 w1 s1t2" in prompts
    assert all(r.prompt_len == 1 for r in result.records), "lengths from the server's usage"
