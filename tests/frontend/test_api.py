from __future__ import annotations

import httpx
import pytest

from gapless.common.block_hash import cache_scope, chain_hashes, hash_root
from gapless.common.messages import AddRequest
from tests.frontend.conftest import MODEL, sse_events
from tests.frontend.fake_engine import FakeEngine

pytestmark = pytest.mark.anyio

PROMPT = "the quick brown fox jumps"


async def test_completion_whole(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    r = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice == {
        "index": 0,
        "text": "the quick brown",
        "logprobs": None,
        "finish_reason": "length",
    }
    (req,) = engine.added
    assert req.params.max_tokens == 3 and req.priority == 0 and req.tenant == ""
    prompt_ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False).ids
    assert req.prompt_token_ids == prompt_ids
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 3,
        "total_tokens": len(prompt_ids) + 3,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


async def test_completion_stops_when_words_run_out(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": "one two", "max_tokens": 10})
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert r.json()["choices"][0]["text"] == "one two"


async def test_completion_token_prompt_and_default_budget(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    ids = engine.tokenizer.encode("hello there", add_special_tokens=False).ids
    for prompt in (ids, [ids]):
        r = await client.post("/v1/completions", json={"prompt": prompt})
        assert r.status_code == 200, r.text
    assert engine.added[0].prompt_token_ids == ids
    assert engine.added[0].params.max_tokens == 16  # OpenAI's default on completions


async def test_completion_bos_only_when_model_adds_it(make_config, engine: FakeEngine) -> None:
    from tests.frontend.conftest import build_app

    app = build_app(make_config(model_overrides={"add_bos_token": True}), engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.post("/v1/completions", json={"prompt": ["hi"], "max_tokens": 1})
    assert r.status_code == 200
    assert engine.added[0].prompt_token_ids[0] == 1


async def test_completion_stream_with_usage(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/completions",
        json={
            "prompt": PROMPT,
            "max_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/event-stream"
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert [c["choices"][0]["text"] for c in chunks] == ["the", " quick"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "length"]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("stream", [False, True])
async def test_usage_reports_cached_prompt_tokens(
    client: httpx.AsyncClient, engine: FakeEngine, stream: bool
) -> None:
    engine.cached_tokens = 2
    body = {"prompt": PROMPT, "max_tokens": 2, "cache_salt": "tenant-a"}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    usage = sse_events(r.text)[-2]["usage"] if stream else r.json()["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 2}
    assert engine.added[0].cache_salt == cache_scope("", "tenant-a")


async def test_the_frontend_names_the_prompts_blocks(
    client: httpx.AsyncClient, engine: FakeEngine, config
) -> None:
    long = " ".join(["word"] * 40)
    r = await client.post("/v1/completions", json={"prompt": long, "cache_salt": "s"})
    assert r.status_code == 200
    (added,) = engine.added
    ids = added.prompt_token_ids
    assert len(ids) >= 32 and len(added.block_hashes) == len(ids) // config.block_size
    root = hash_root(config.model.path, cache_scope("", "s"))
    assert added.block_hashes == chain_hashes(root, ids, 16)


async def test_an_empty_cache_salt_is_refused(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": PROMPT, "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


async def test_completion_n2_seeds_and_logprobs(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    r = await client.post(
        "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 2, "n": 2, "seed": 7, "logprobs": 2},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [a.params.seed for a in engine.added] == [7, 8]
    ids = [a.request_id for a in engine.added]
    assert ids[0].endswith("-0") and ids[1].endswith("-1") and ids[0][:-2] == ids[1][:-2]
    lp = body["choices"][1]["logprobs"]
    assert lp["tokens"] == ["the", " quick"]
    assert lp["token_logprobs"] == [-0.5, -0.5]
    assert lp["text_offset"] == [0, 3]
    assert lp["top_logprobs"][0] == {"the#0": -1.0, "the#1": -2.0}
    assert body["usage"]["completion_tokens"] == 4


async def test_chat_whole(client: httpx.AsyncClient, engine: FakeEngine, hf_tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}],
        },
    ]
    r = await client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_completion_tokens": 4, "user": "alice"},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    (req,) = engine.added
    text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi\nthere<|im_end|>\n"
    text += "<|im_start|>assistant\n"
    assert req.prompt_token_ids == engine.tokenizer.encode(text, add_special_tokens=False).ids
    assert req.tenant == "alice" and req.params.max_tokens == 4


async def test_chat_stream_n2_logprobs_usage(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/v1/chat/completions",
        headers={"x-tenant": "team-a"},
        json={
            "messages": [{"role": "user", "content": "alpha beta gamma"}],
            "max_tokens": 2,
            "n": 2,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 1,
            "stream_options": {"include_usage": True},
        },
    )
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    chunks = events[:-2]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[-1]["finish_reason"] == "length"
        content = mine[1]["logprobs"]["content"][0]
        assert set(content) == {"token", "logprob", "bytes", "top_logprobs"}
        assert content["bytes"] == list(content["token"].encode())
        assert len(content["top_logprobs"]) == 1


async def test_chat_priority_and_extras(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    r = await client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 1,
            "priority": "batch",
            "top_k": -1,
            "min_p": 0.1,
            "repetition_penalty": 1.2,
            "stop": "END",
            "stop_token_ids": [5],
            "ignore_eos": True,
            "temperature": 0,
            "top_p": None,
        },
    )
    assert r.status_code == 200, r.text
    req: AddRequest = engine.added[0]
    assert req.priority == 10
    p = req.params
    assert (p.top_k, p.min_p, p.repetition_penalty, p.temperature, p.top_p) == (0, 0.1, 1.2, 0, 1)
    assert p.stop == ("END",) and p.stop_token_ids == (5,) and p.ignore_eos


async def test_models_health_openapi(client: httpx.AsyncClient) -> None:
    r = await client.get("/v1/models")
    assert r.status_code == 200
    assert r.json()["data"][0]["id"] == MODEL and r.json()["object"] == "list"
    r = await client.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok", "reason": None}
    doc = (await client.get("/openapi.json")).json()
    assert doc["openapi"].startswith("3.1")
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= set(doc["paths"])
    schemas = doc["components"]["schemas"]
    assert "messages" in schemas["ChatCompletionRequest"]["properties"]

    def refs(node):  # every $ref in the document resolves
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "$ref":
                    yield v
                else:
                    yield from refs(v)
        elif isinstance(node, list):
            for v in node:
                yield from refs(v)

    for ref in refs(doc):
        assert ref.removeprefix("#/components/schemas/") in schemas, ref
