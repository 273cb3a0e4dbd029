"""The official openai client against the app on a real uvicorn (in a thread), fake engine."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import uvicorn

from gapless.frontend.server import bind_socket
from tests.frontend.conftest import MODEL, build_app
from tests.frontend.fake_engine import FakeEngine
from tests.timing import late_limit_s


@pytest.fixture(scope="module")
def engine(hf_tokenizer) -> FakeEngine:
    return FakeEngine(hf_tokenizer[0])


@pytest.fixture(scope="module")
def base_url(make_config, engine: FakeEngine) -> Iterator[str]:
    app = build_app(make_config(api_key="k"), engine)
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, loop="uvloop", http="httptools", lifespan="off", log_level="warning")
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(5)
    sock.close()


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="k", max_retries=0, timeout=10)


def test_completions(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="one two three", max_tokens=2, logprobs=1)
    assert r.object == "text_completion"
    assert r.choices[0].text == "one two" and r.choices[0].finish_reason == "length"
    assert r.choices[0].logprobs.tokens == ["one", " two"]
    assert r.usage.completion_tokens == 2 and r.usage.total_tokens == r.usage.prompt_tokens + 2

    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="one two three",
            max_tokens=3,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    for index in (0, 1):
        text = "".join(
            c.choices[0].text for c in chunks if c.choices and c.choices[0].index == index
        )
        assert text == "one two three"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_chat(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "red green"}]
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=2,
        logprobs=True,
        top_logprobs=2,
        extra_body={"priority": "interactive", "top_k": 5},
    )
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert len(choice.logprobs.content) == 2 and len(choice.logprobs.content[0].top_logprobs) == 2
    assert r.usage.completion_tokens == 2

    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content + " user" == "system s user"
    assert chunks[-1].usage.completion_tokens == 3


def test_errors_reach_the_client(client: openai.OpenAI, base_url: str) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=5)
    assert "temperature" in str(bad.value) and bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base_url + "/v1", api_key="bad", max_retries=0).models.list()
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(base_url + "/health").status_code == 200


def test_tcp_disconnect_aborts_within_a_second(base_url: str, engine: FakeEngine) -> None:
    engine.delay_s = 0.05  # slow enough that the client leaves mid-stream
    try:
        with httpx.stream(
            "POST",
            base_url + "/v1/completions",
            headers={"authorization": "Bearer k"},
            json={"prompt": "a b c d e f g h", "max_tokens": 100, "stream": True},
        ) as r:
            assert next(r.iter_raw()).startswith(b"data: ")
        left = time.monotonic()
        rid = engine.added[-1].request_id
        while rid not in engine.aborted:
            assert time.monotonic() - left < late_limit_s(1.0), "no Abort within a second"
            time.sleep(0.01)
    finally:
        engine.delay_s = 0.0


def test_prediction_on_chat_and_completions(client: openai.OpenAI, engine: FakeEngine) -> None:
    """`prediction` reaches the engine as ids; usage counts the predicted ids found in the
    output (accepted) and the rest (rejected); completions take it through extra_body, with
    text parts."""
    messages = [{"role": "user", "content": "red green"}]
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=2,
        prediction={"type": "content", "content": "red green blue"},
    )
    predicted = engine.added[-1].prediction
    assert predicted
    details = r.usage.completion_tokens_details
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == len(predicted)
    assert r.usage.completion_tokens == 2  # output tokens only

    pred = {
        "type": "content",
        "content": [{"type": "text", "text": "one "}, {"type": "text", "text": "two"}],
    }
    r = client.completions.create(
        model=MODEL, prompt="one two three", max_tokens=2, n=2, extra_body={"prediction": pred}
    )
    predicted = engine.added[-1].prediction
    assert predicted and engine.added[-2].prediction == predicted  # each choice drafts alone
    details = r.usage.completion_tokens_details
    total = details.accepted_prediction_tokens + details.rejected_prediction_tokens
    assert total == 2 * len(predicted)
