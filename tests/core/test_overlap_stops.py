"""With two steps in flight, nothing past a request's end reaches the client and its KV blocks
come back exactly once, whatever ended it."""

from __future__ import annotations

import json

import httpx
import pytest

from gapless.common.model_files import load_tokenizer, resolve_model
from tests.server import Server

pytestmark = pytest.mark.slow
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    s = Server("--model", str(tiny_model_dir), "--dtype", "float32", "--served-model-name", "tiny")
    yield s
    assert s.stop() == 0, s.read_log()


def _complete(server, **body) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "temperature": 0, "ignore_eos": True, **body}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0] | {"usage": r.json()["usage"]}


def _assert_idle(server) -> None:
    s = httpx.get(server.url + "/v1/engine/stats", timeout=10).json()
    assert s["num_free_blocks"] == s["num_total_blocks"] and s["num_running"] == 0


def test_max_tokens_and_stop_string(server):
    ref = _complete(server, max_tokens=24)
    text = ref["text"]
    r = _complete(server, max_tokens=5)
    assert r["usage"]["completion_tokens"] == 5 and text.startswith(r["text"])
    assert r["finish_reason"] == "length"
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    r = _complete(server, max_tokens=24, stop=[stop])
    assert r["text"] == text[: text.index(stop)] and r["finish_reason"] == "stop"
    _assert_idle(server)


def test_stop_token_id_ends_where_it_first_appears(server, tiny_model_dir):
    ref = _complete(server, max_tokens=24, logprobs=0)
    pieces = ref["logprobs"]["tokens"]
    tok = load_tokenizer(resolve_model(str(tiny_model_dir)))
    k, stop_id = next(
        (i, ids[0])
        for i, p in enumerate(pieces)
        if len(ids := tok.encode(p, add_special_tokens=False).ids) == 1 and p not in pieces[:i]
    )
    r = _complete(server, max_tokens=24, stop_token_ids=[stop_id])
    assert r["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] == k + 1, "generation ends at the stop token"
    assert r["text"] == "".join(pieces[:k]), "the stop token's text is not sent"
    _assert_idle(server)


def test_streams_never_pass_their_end(server):
    for body in ({"max_tokens": 7}, {"max_tokens": 24, "stop": ["e"]}):
        chunks = []
        with httpx.stream(
            "POST",
            server.url + "/v1/completions",
            timeout=60,
            json={
                "model": "tiny",
                "prompt": PROMPT,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                **body,
            },
        ) as resp:
            chunks = [
                json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")
            ]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])
        if "stop" in body:
            assert "e" not in text
        whole = _complete(server, **body)
        assert text == whole["text"]
    _assert_idle(server)
