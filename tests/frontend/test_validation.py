from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gapless.frontend.http.asgi import HttpRequest
from gapless.frontend.http.json_depth import MAX_JSON_DEPTH
from tests.frontend.conftest import build_app

pytestmark = pytest.mark.anyio

USER = [{"role": "user", "content": "hi"}]
LONG = "word " * 300  # > 256 tokens, the test context length

COMPLETION_CASES: list[tuple[Any, int, str | None]] = [
    ({}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": ["a", ""]}, 400, "prompt"),
    ({"prompt": [[1], []]}, 400, "prompt"),
    ({"prompt": ["a"] * 65}, 400, "prompt"),
    ({"prompt": [1, "a"]}, 400, "prompt"),
    ({"prompt": [49152]}, 400, "prompt"),
    ({"prompt": [-1]}, 400, "prompt"),
    ({"prompt": LONG}, 400, "prompt"),
    ({"prompt": "hi", "max_tokens": "x"}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10**30}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 256}, 400, "max_tokens"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "n": 5}, 400, "n"),
    ({"prompt": "hi", "n": 1.5}, 400, "n"),
    ({"prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    ({"prompt": "hi", "logprobs": -1}, 400, "logprobs"),
    ({"prompt": "hi", "temperature": -0.1}, 400, "temperature"),
    ({"prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ({"prompt": "hi", "min_p": 2}, 400, "min_p"),
    ({"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ({"prompt": "hi", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ({"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"prompt": "hi", "stop": ["s"] * 17}, 400, "stop"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop"),
    ({"prompt": "hi", "stop": 3}, 400, "stop"),
    ({"prompt": "hi", "stop_token_ids": [99999]}, 400, "stop_token_ids"),
    ({"prompt": "hi", "seed": 2**64}, 400, "seed"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"prompt": "hi", "priority": "urgent"}, 400, "priority"),
    ({"prompt": "hi", "priority": 1001}, 400, "priority"),
    ({"prompt": "hi", "priority": -1001}, 400, "priority"),
    ({"prompt": "hi", "priority": 1.5}, 400, "priority"),
    ({"prompt": "hi", "priority": 10**30}, 400, "priority"),
    ({"prompt": "hi", "priority": True}, 400, "priority"),
    ({"prompt": "hi", "priority": ["batch"]}, 400, "priority"),
    ({"prompt": "hi", "user": "a\u0007b"}, 400, "user"),
    ({"prompt": "hi", "best_of": 2}, 400, "best_of"),
    ({"prompt": "hi", "n": 2, "best_of": 3}, 400, "best_of"),
    ({"prompt": "hi", "suffix": "end"}, 400, "suffix"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"49152": 1}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"5": "a"}}, 400, "logit_bias[...]"),
    ({"prompt": "hi", "min_tokens": -1}, 400, "min_tokens"),
    ({"prompt": "hi", "min_tokens": 17}, 400, "min_tokens"),
    ({"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ({"prompt": "hi", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ({"prompt": "hi", "allowed_token_ids": [49152]}, 400, "allowed_token_ids"),
    ({"prompt": "hi", "bad_words": [" "]}, 400, "bad_words"),
    ({"prompt": "hi", "user": "u" * 300}, 400, "user"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ([1, 2], 400, None),
]

CHAT_CASES: list[tuple[Any, int, str | None]] = [
    ({}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [USER[0], {"role": "user", "content": 5}]}, 400, "messages[1].content"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
        400,
        "messages[0].content[0].type",
    ),
    ({"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ({"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 6}, 400, "top_logprobs"),
    ({"messages": USER, "logprobs": 1}, 400, "logprobs"),
    ({"messages": USER, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ({"messages": USER, "max_tokens": 250}, 400, "max_tokens"),
    ({"messages": USER, "n": 9}, 400, "n"),
    ({"messages": USER, "temperature": 3}, 400, "temperature"),
    ({"messages": USER, "priority": "Batch"}, 400, "priority"),
    ({"messages": USER, "priority": 2000}, 400, "priority"),
    ({"messages": USER, "user": "u\n"}, 400, "user"),
    ({"messages": USER, "model": "nope"}, 404, "model"),
    ({"messages": USER, "audio": {"voice": "alloy", "format": "wav"}}, 400, "audio"),
    ({"messages": USER, "modalities": ["text", "audio"]}, 400, "modalities"),
    ({"messages": USER, "prediction": {"type": "image", "content": "x"}}, 400, "prediction.type"),
    ({"messages": USER, "functions": [{"name": "f"}]}, 400, "functions"),
    ({"messages": USER, "function_call": "auto"}, 400, "function_call"),
    ({"messages": USER, "reasoning_effort": "high"}, 400, "reasoning_effort"),
    ({"messages": USER, "verbosity": "low"}, 400, "verbosity"),
    ({"messages": USER, "web_search_options": {}}, 400, "web_search_options"),
    ({"messages": USER, "moderation": {"policy": {}}}, 400, "moderation"),
    ({"messages": USER, "logit_bias": {"-1": 5}}, 400, "logit_bias"),
    ({"messages": USER, "max_tokens": 3, "min_tokens": 4}, 400, "min_tokens"),
]


def _check_error(
    r: httpx.Response, status: int, param: str | None, *, named: bool = True
) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None and named:
        assert param.split("[")[0].split(".")[0] in error["message"] or param in error["message"]
    return error


@pytest.mark.parametrize(("body", "status", "param"), COMPLETION_CASES)
async def test_completion_rejects(client: httpx.AsyncClient, engine, body, status, param) -> None:
    _check_error(await client.post("/v1/completions", json=body), status, param)
    assert engine.added == []


@pytest.mark.parametrize(("body", "status", "param"), CHAT_CASES)
async def test_chat_rejects(client: httpx.AsyncClient, engine, body, status, param) -> None:
    _check_error(await client.post("/v1/chat/completions", json=body), status, param)
    assert engine.added == []


async def test_malformed_json(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", content=b'{"prompt": "a",')
    assert _check_error(r, 400, None)["code"] == "invalid_json"


async def test_routes_404_405(client: httpx.AsyncClient) -> None:
    assert _check_error(await client.get("/v2/nothing"), 404, None)["code"] == "not_found"
    r = await client.get("/v1/completions")
    assert _check_error(r, 405, None)["code"] == "method_not_allowed"
    assert r.headers["allow"] == "POST"


async def test_body_too_large(make_config, engine) -> None:
    app = build_app(make_config(max_body_bytes=1000), engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.post("/v1/completions", json={"prompt": "x" * 2000})
        assert _check_error(r, 413, None)["code"] == "body_too_large"

    # no content-length: the streamed size is what counts
    chunks = [{"type": "http.request", "body": b"x" * 600, "more_body": True}] * 3
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return chunks.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    await app(scope, receive, send)
    assert sent[0]["status"] == 413 and len(chunks) == 1


async def test_api_key(make_config, engine) -> None:
    app = build_app(make_config(api_key="sekret"), engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        assert (await c.get("/health")).status_code == 200
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic sekret"}):
            r = await c.get("/v1/models", headers=headers)
            assert _check_error(r, 401, None)["code"] == "invalid_api_key"
            r = await c.post("/v1/completions", headers=headers, json={"prompt": "a"})
            assert r.status_code == 401
        good = {"authorization": "Bearer sekret"}
        assert (await c.get("/v1/models", headers=good)).status_code == 200
        r = await c.post("/v1/completions", headers=good, json={"prompt": "a", "max_tokens": 1})
        assert r.status_code == 200
    assert engine.added[0].tenant.startswith("key-")  # the key's identity, not the key
    assert "sekret" not in engine.added[0].tenant


async def test_chat_template_failures(make_config, engine) -> None:
    cases = {
        "{{ raise_exception('no system role') }}": "no system role",
        "{{ messages.__class__.__mro__ }}": "unsafe",
        "{% for i in range(100000) %}{% for j in range(100000) %}{% set x = i %}"
        "{% endfor %}{% endfor %}": "longer than",
        "{% for m in messages %}": "does not compile",
        None: "no chat template",
    }
    for template, words in cases.items():
        config = make_config(
            model_overrides={"chat_template": template}, chat_template_timeout_s=0.2
        )
        app = build_app(config, engine)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.post("/v1/chat/completions", json={"messages": USER})
        error = _check_error(
            r, 400, "messages", named=words not in ("does not compile", "no chat template")
        )
        assert words in error["message"], (template, error)


async def test_internal_error_is_500_for_that_request_only(
    client: httpx.AsyncClient, app, monkeypatch
) -> None:
    async def broken(prompt):
        raise RuntimeError("bug")

    monkeypatch.setattr(app.state.prompter, "completion_prompts", broken)
    r = await client.post("/v1/completions", json={"prompt": "a"})
    assert _check_error(r, 500, None)["code"] == "internal_error"
    monkeypatch.undo()
    r = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
    assert r.status_code == 200


def test_request_head_keeps_last_header() -> None:
    scope = {"method": "GET", "path": "/", "headers": [(b"x-tenant", b"a"), (b"x-tenant", b"b")]}
    assert HttpRequest(scope, None).headers["x-tenant"] == "b"  # type: ignore[arg-type]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    "content, code",
    [
        (
            b'{"prompt": "a", "messages": [], "metadata": ' + b"[" * 1000 + b"]" * 1000 + b"}",
            "json_too_deep",
        ),
        (
            b'{"prompt": "\xff\xfe", "messages": [{"role": "user", "content": "\xc3"}]}',
            "invalid_utf8",
        ),
    ],
    ids=["deep", "utf8"],
)
async def test_hostile_json_is_a_named_400(
    client: httpx.AsyncClient, path: str, content: bytes, code: str
) -> None:
    r = await client.post(path, content=content)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == code


@pytest.fixture
def recursion_limit_raised() -> Iterator[None]:
    """The interpreter's recursion limit raised far past any nesting a test sends, as a test
    framework in the same process may leave it (hypothesis does): the server's bound must not
    depend on it."""
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(100_000)
    yield
    sys.setrecursionlimit(before)


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# (depth, status): at the bound, one past it, and deep enough to crash a parser bounded only by
# the recursion limit (4 MB, under the body cap)
DEPTHS = [(MAX_JSON_DEPTH, 200), (MAX_JSON_DEPTH + 1, 400), (2_000_000, 400)]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_body_nesting_bound_is_the_servers(
    client: httpx.AsyncClient, recursion_limit_raised: None, path: str
) -> None:
    ok = {"prompt": "a", "messages": USER, "max_tokens": 1}
    for depth, status in DEPTHS:
        # the body's own object is one level: the field under it holds depth - 1
        head = json.dumps({**ok, "x_extra": 0})[:-3].encode()
        content = head + _nested(depth - 1).encode() + b"}"
        r = await client.post(path, content=content)
        if status == 200:
            assert r.status_code == 200, r.text
        else:
            error = _check_error(r, 400, None)
            assert error["code"] == "json_too_deep" and str(MAX_JSON_DEPTH) in error["message"]
        assert (await client.post(path, json=ok)).status_code == 200  # it serves the next one


async def test_deep_tool_call_arguments_are_a_400_naming_them(
    client: httpx.AsyncClient, recursion_limit_raised: None
) -> None:
    def body(arguments: str) -> dict[str, Any]:
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        return {
            "messages": [*USER, {"role": "assistant", "tool_calls": [call]}],
            "max_tokens": 1,
        }

    for depth, status in DEPTHS:
        r = await client.post("/v1/chat/completions", json=body(_nested(depth)))
        if status == 200:
            assert r.status_code == 200, r.text
        else:
            param = "messages[1].tool_calls[0].function.arguments"
            assert _check_error(r, 400, param)["code"] == "json_too_deep"
        r = await client.post("/v1/chat/completions", json=body('{"city": "Paris"}'))
        assert r.status_code == 200, r.text


async def test_brackets_in_strings_do_not_nest(make_config, engine) -> None:
    app = build_app(make_config(model_overrides={"max_model_len": 200_000}), engine)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        for prompt in ("[" * 100_000, '{"a": [' * 10_000 + '\\"]'):
            r = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            assert r.status_code == 200, r.text
