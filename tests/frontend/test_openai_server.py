"""The official openai client against a real `gapless serve` on a tiny random Llama."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import openai
import pytest

from tests.server import Server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    s = Server(
        "--model",
        str(tiny_model_dir),
        "--dtype",
        "float32",
        "--served-model-name",
        "tiny",
        "--max-num-seqs",
        "40",
        "--max-model-len",
        "512",
    )
    yield s
    assert s.stop() == 0, s.read_log()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_completion_and_usage(client):
    r = client.completions.create(
        model="tiny",
        prompt="Hello there",
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5


def test_streaming_completion_equals_non_streaming(client):
    kw = dict(
        model="tiny",
        prompt="Once upon a time",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streaming_and_not(client):
    msgs = [{"role": "user", "content": "Say hi"}]
    r = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == 6
    stream = client.chat.completions.create(
        model="tiny",
        messages=msgs,
        max_tokens=6,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == r.choices[0].message.content


def test_prompt_as_token_ids(client):
    r = client.completions.create(
        model="tiny",
        prompt=[1, 2000, 3000],
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 3


def test_seeded_sampling_repeats(client):
    kw = dict(
        model="tiny",
        prompt="abc",
        max_tokens=10,
        temperature=1.0,
        seed=42,
        extra_body={"ignore_eos": True},
    )
    first, second = client.completions.create(**kw), client.completions.create(**kw)
    assert first.usage.completion_tokens == second.usage.completion_tokens == 10
    assert first.choices[0].text == second.choices[0].text


def test_32_concurrent_greedy_streams_equal_their_solo_output(client):
    prompts = [f"Request number {i} says" for i in range(32)]

    def run(p: str) -> str:
        stream = client.completions.create(
            model="tiny",
            prompt=p,
            max_tokens=16,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join(c.choices[0].text for c in stream if c.choices)

    solo = [run(p) for p in prompts[:8]]
    with cf.ThreadPoolExecutor(32) as pool:
        together = list(pool.map(run, prompts))
    assert all(together), "every stream produced text"
    assert together[:8] == solo
    again = [run(p) for p in prompts[8:12]]
    assert together[8:12] == again


def test_bad_inputs_get_clear_errors_and_the_engine_goes_on(server, client):
    url = server.url + "/v1/completions"
    cases = [
        ({"model": "tiny", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "n": 1000}, 400, "n"),
        ({"model": "tiny", "prompt": "x", "logprobs": 1000}, 400, "logprobs"),
        ({"model": "tiny", "prompt": ""}, 400, "prompt"),
        ({"model": "tiny", "prompt": "hello " * 600}, 400, "prompt"),
        ({"model": "nope", "prompt": "x"}, 404, "model"),
    ]
    for body, status, field in cases:
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == status, (body, r.text)
        assert field in r.json()["error"]["message"], r.text
    r = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=30,
        json={"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]},
    )
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    r = httpx.post(url, content=b"x" * (5 * 2**20), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert httpx.get(server.url + "/v1/nothing").status_code == 404
    # and the engine still serves
    ok = client.completions.create(
        model="tiny", prompt="still alive", max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert ok.usage.completion_tokens == 2


def test_models_and_openapi(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    spec = httpx.get(server.url + "/openapi.json").json()
    assert "/v1/chat/completions" in spec["paths"] and "/v1/completions" in spec["paths"]


def test_embeddings_equal_transformers_base64_and_float(client, tiny_model_dir):
    """client.embeddings.create (base64, the client's default) and float: the last token's
    final hidden state, normalized (no sentence-transformers files), as transformers has it;
    batched equals alone. Mean and CLS pooling: tests/gpu_runner/test_pooling.py."""
    import numpy as np
    import tokenizers
    import torch
    import transformers

    texts = ["The capital of France is Paris.", "Queues grow when the device waits."]
    b64 = client.embeddings.create(model="tiny", input=texts)
    floats = client.embeddings.create(model="tiny", input=texts, encoding_format="float")
    alone = client.embeddings.create(model="tiny", input=texts[1])
    tok = tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).float().eval()
    ids = [tok.encode(t).ids for t in texts]
    assert b64.usage.prompt_tokens == b64.usage.total_tokens == sum(map(len, ids))
    for i, prompt in enumerate(ids):
        with torch.no_grad():
            want = ref.model(torch.tensor([prompt])).last_hidden_state[0, -1].numpy()
        got = np.asarray(b64.data[i].embedding)
        assert float(got @ want / np.linalg.norm(want)) >= 0.9999
        np.testing.assert_allclose(floats.data[i].embedding, got, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(alone.data[0].embedding, b64.data[1].embedding, atol=1e-6)
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="tiny", input=[])
    assert err.value.body["param"] == "input"
