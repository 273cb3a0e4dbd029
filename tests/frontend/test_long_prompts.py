"""A text longer than the model could ever accept is refused before it is tokenized, and
tokenizing a long one does not stop the event loop: /health answers throughout."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import httpx
import pytest

from tests.frontend.conftest import MAX_MODEL_LEN, build_app, served

WORDS = ["hello", "world", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "42,"]
HEALTH_BOUND_S = 0.3


def _text(num_chars: int) -> str:
    rng = random.Random(0)
    words = " ".join(rng.choice(WORDS) for _ in range(num_chars // 4))
    return (words * (num_chars // max(len(words), 1) + 1))[:num_chars]


class _TokenizerSpy:
    """The tokenizer, recording every encode call made through it."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.encoded: list[int] = []  # characters of each text encoded

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._tokenizer, name)
        if not name.startswith("encode"):
            return attr

        def encode(text: Any, *args: Any, **kwargs: Any) -> Any:
            texts = text if isinstance(text, list) else [text]
            self.encoded += [len(t) for t in texts]
            return attr(text, *args, **kwargs)

        return encode


def test_the_bound_is_the_context_times_the_longest_token(engine) -> None:
    from gapless.frontend.api.prompts import max_prompt_chars

    longest = max(map(len, engine.tokenizer.get_vocab(with_added_tokens=True)))
    assert engine.tokenizer.normalizer is None  # byte-level BPE: one character per byte
    assert max_prompt_chars(engine.tokenizer, MAX_MODEL_LEN) == MAX_MODEL_LEN * longest
    # the longest token repeated to fill the context is a prompt that fits, at the bound
    token = max(engine.tokenizer.get_vocab(), key=len)
    text = engine.tokenizer.decode([engine.tokenizer.token_to_id(token)])
    assert len(engine.tokenizer.encode(text * MAX_MODEL_LEN, add_special_tokens=False)) == (
        MAX_MODEL_LEN
    )


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", lambda t: {"prompt": t}, "prompt"),
        ("/v1/completions", lambda t: {"prompt": ["hi", t]}, "prompt"),
        ("/v1/completions", lambda t: {"prompt": "hi", "bad_words": [t]}, "bad_words"),
        (
            "/v1/chat/completions",
            lambda t: {"messages": [{"role": "user", "content": t}]},
            "messages",
        ),
        ("/tokenize", lambda t: {"prompt": t}, "prompt"),
        ("/tokenize", lambda t: {"messages": [{"role": "user", "content": t}]}, "messages"),
    ],
)
async def test_a_text_too_long_for_any_context_is_refused_before_tokenizing(
    config, engine, path, body, param
) -> None:
    app = build_app(config, engine)
    prompter = app.state.prompter
    spy = prompter.tokenizer = _TokenizerSpy(prompter.tokenizer)
    text = _text(prompter.max_chars + 1)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        r = await client.post(path, json=body(text))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == "context_length_exceeded"
    assert str(prompter.max_chars) in error["message"]
    assert all(n < prompter.max_chars for n in spy.encoded), "the long text was tokenized"
    assert not engine.added


def _probe_health(port: int, stop: threading.Event) -> list[float]:
    latencies = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            client.get("/health")  # 200, or 503 once the fake engine's heartbeat is old
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.02)
    return latencies


def _while_probing(port: int, send: Any, num: int) -> tuple[list[int], list[float]]:
    """`num` calls of send(client) at once, with /health probed until they all answered."""
    stop = threading.Event()
    latencies: list[float] = []
    prober = threading.Thread(target=lambda: latencies.extend(_probe_health(port, stop)))
    prober.start()
    statuses: list[int] = []

    def one() -> None:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            statuses.append(send(client))

    senders = [threading.Thread(target=one) for _ in range(num)]
    time.sleep(0.1)
    for t in senders:
        t.start()
    for t in senders:
        t.join()
    time.sleep(0.1)
    stop.set()
    prober.join()
    return statuses, latencies


def test_health_answers_while_3mb_prompts_come(make_config, engine) -> None:
    text = _text(3_000_000)
    # the test context: refused before tokenizing, four at once
    with served(make_config(), engine) as port:
        statuses, latencies = _while_probing(
            port, lambda c: c.post("/v1/completions", json={"prompt": text}).status_code, 4
        )
    assert statuses == [400] * 4
    assert max(latencies) < HEALTH_BOUND_S, max(latencies)
    # a context that takes it: tokenized, without holding the event loop
    with served(make_config(model_overrides={"max_model_len": 10**6}), engine) as port:
        statuses, latencies = _while_probing(
            port, lambda c: c.post("/tokenize", json={"prompt": text}).status_code, 1
        )
    assert statuses == [200]
    assert len(latencies) > 10 and max(latencies) < HEALTH_BOUND_S, max(latencies)


def _many_tokens_per_char(num_chars: int) -> str:
    """Rare CJK characters: a byte-level BPE spends several tokens on each."""
    return "".join(chr(0x20000 + (i * 7919) % 40000) for i in range(num_chars))


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", lambda t: {"prompt": t}, "prompt"),
        ("/v1/chat/completions", lambda t: {"messages": [{"role": "user", "content": t}]},
         "messages"),
    ],
)  # fmt: skip
async def test_a_text_under_the_cap_of_many_tokens_is_refused_piece_by_piece(
    make_config, engine, path, body, param
) -> None:
    """Under the character cap but several tokens a character: counted a piece at a time and
    refused once the count passes the context, never tokenized whole (so the tokenizer's
    memory, ~140 bytes a token, stays bounded by the context rather than the body)."""
    from gapless.frontend.api.prompts import PIECE_CHARS

    app = build_app(make_config(model_overrides={"max_model_len": 4096}), engine)
    prompter = app.state.prompter
    spy = prompter.tokenizer = _TokenizerSpy(prompter.tokenizer)
    text = _many_tokens_per_char(prompter.max_chars // 2)
    assert len(text) > 4 * PIECE_CHARS
    assert len(engine.tokenizer.encode(text[:1000], add_special_tokens=False)) > 2000
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        r = await client.post(path, json=body(text))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == "context_length_exceeded", error
    assert "at least" in error["message"], error
    assert max(spy.encoded) <= PIECE_CHARS, "a piece larger than PIECE_CHARS was tokenized"
    assert sum(spy.encoded) <= 2 * PIECE_CHARS, "counting went on past the context"
    assert not engine.added


def test_a_long_text_that_fits_gets_the_ids_of_the_whole(make_config, engine) -> None:
    from gapless.frontend.api.prompts import PIECE_CHARS, Prompter, text_pieces

    text = _text(3 * PIECE_CHARS + 123)
    pieces = text_pieces(text, PIECE_CHARS)
    assert "".join(pieces) == text and len(pieces) == 4
    assert all(len(p) <= PIECE_CHARS for p in pieces)
    assert all(p.startswith((" ", "\n")) for p in pieces[1:]), "cut before a space"
    config = make_config(model_overrides={"max_model_len": 10**6})
    prompter = Prompter(engine.tokenizer, config)
    assert prompter._ids(text) == engine.tokenizer.encode(text, add_special_tokens=False).ids
