"""X-Request-Id honoured or made up, returned, carried to the engine; one access line per
request; the log formats."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from gapless.common.logs import JsonFormatter, TextFormatter

pytestmark = pytest.mark.anyio


def _access(caplog) -> list[dict]:
    return [r.fields for r in caplog.records if r.name == "gapless.access"]


async def test_request_id_is_honoured_returned_and_carried(client: httpx.AsyncClient, engine):
    body = {"prompt": "one two three", "max_tokens": 2}
    r = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "abc-123"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"
    assert engine.added[-1].label == "abc-123"
    assert engine.added[-1].request_id != "abc-123", "the engine keeps its own unique key"
    again = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "abc-123"})
    assert again.status_code == 200, "clients reuse ids; the engine does not mind"
    made = await client.post("/v1/completions", json=body)
    assert (
        len(made.headers["x-request-id"]) == 32
        and engine.added[-1].label == made.headers["x-request-id"]
    )
    bad = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "a b\x01"})
    assert bad.headers["x-request-id"] != "a b\x01"
    err = await client.post("/v1/completions", json={}, headers={"X-Request-Id": "e-1"})
    assert err.status_code == 400 and err.headers["x-request-id"] == "e-1"


async def test_one_access_line_per_request(client: httpx.AsyncClient, caplog) -> None:
    caplog.set_level(logging.INFO, logger="gapless.access")
    body = {"prompt": "one two three four", "max_tokens": 3, "stream": True}
    r = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "s-1"})
    assert r.status_code == 200
    await client.post("/v1/completions", json={"prompt": 5}, headers={"X-Request-Id": "s-2"})
    await client.get("/health")  # a probe: debug level only
    lines = _access(caplog)
    assert [line["request_id"] for line in lines] == ["s-1", "s-2"]
    ok, bad = lines
    assert ok["method"] == "POST" and ok["route"] == "/v1/completions" and ok["status"] == 200
    assert ok["completion_tokens"] == 3 and ok["prompt_tokens"] > 0
    assert ok["ttft_ms"] is not None and ok["duration_ms"] >= ok["ttft_ms"]
    assert ok["finish_reason"] == "length"
    assert bad["status"] == 400 and bad["completion_tokens"] == 0


def test_json_and_text_formats() -> None:
    record = logging.LogRecord("gapless.access", logging.INFO, "f", 1, "access", None, None)
    record.fields = {"status": 200, "route": "/v1/completions"}
    obj = json.loads(JsonFormatter("front0").format(record))
    assert obj["msg"] == "access" and obj["status"] == 200 and obj["role"] == "front0"
    assert obj["level"] == "info" and isinstance(obj["ts"], float)
    text = TextFormatter("front0").format(record)
    assert text.endswith("access status=200 route=/v1/completions") and " INFO " in text


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "one two three four five six"}),
        ("/v1/completions", {"prompt": ["one two three four", "five six seven"], "n": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "one two three"}]}),
    ],
)
async def test_the_access_line_counts_prompt_tokens(
    client: httpx.AsyncClient, caplog, path: str, body: dict
) -> None:
    """prompt_tokens is the usage's count (each prompt once), not the number of prompts."""
    caplog.set_level(logging.INFO, logger="gapless.access")
    r = await client.post(path, json={**body, "max_tokens": 1})
    assert r.status_code == 200, r.text
    (line,) = _access(caplog)
    assert line["prompt_tokens"] == r.json()["usage"]["prompt_tokens"] > 3
