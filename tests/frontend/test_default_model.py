"""The default model, SmolLM2-135M-Instruct from its GGUF, through the server and the openai
client, against transformers' greedy generation on the same file in fp32."""

from __future__ import annotations

import time

import numpy as np
import openai
import pytest
import torch

from tests.server import Server

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def reference(default_gguf):
    d, f = str(default_gguf.parent), default_gguf.name
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        d, gguf_file=f, torch_dtype=torch.float32
    )
    ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt")
    if not isinstance(ids, torch.Tensor):
        ids = ids["input_ids"]
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=32,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=tok.eos_token_id,
        )
    new = out[0, ids.shape[1] :].tolist()
    return tok.decode(new, skip_special_tokens=True), new


@pytest.fixture(scope="module")
def server():
    s = Server("--dtype", "float32")  # no --model: the default
    yield s
    assert s.stop() == 0, s.read_log()


def test_capital_of_france_and_first_32_tokens_match_transformers(server, reference):
    want_text, want_ids = reference
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    assert model == "SmolLM2-135M-Instruct"
    r = client.chat.completions.create(
        model=model,
        messages=QUESTION,
        temperature=0,
        max_tokens=32,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    text = r.choices[0].message.content
    assert "Paris" in text
    got_ids = [c.token for c in r.choices[0].logprobs.content]
    assert len(got_ids) == 32
    assert text == want_text, f"gapless: {text!r}\ntransformers: {want_text!r}"


def _streamed(client, model, prompt, **extra):
    """(TTFT s, text, usage) of one streamed greedy completion, timed at the client."""
    t0 = time.perf_counter()
    ttft, parts, usage = None, [], None
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, **extra},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            ttft = ttft or time.perf_counter() - t0
            parts.append(chunk.choices[0].text)
        if chunk.usage is not None:
            usage = chunk.usage
    return ttft, "".join(parts), usage


def test_a_shared_1024_token_prefix_is_reused(server):
    """The second request's prefix comes from the cache: it reports >= 1,008 cached tokens
    (all but the last partial block), answers as a request that computes everything (another
    cache salt), and its TTFT is printed against the first's (the bench records it)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    rng = np.random.default_rng(9)
    prefix = rng.integers(100, 40000, 1024).tolist()
    first = prefix + rng.integers(100, 40000, 8).tolist()
    second = prefix + rng.integers(100, 40000, 8).tolist()
    ttft_first, _, usage_first = _streamed(client, model, first)
    ttft_second, text, usage = _streamed(client, model, second)
    assert usage_first.prompt_tokens_details.cached_tokens == 0
    assert usage.prompt_tokens == 1032 and usage.prompt_tokens_details.cached_tokens >= 1008
    _, text_uncached, usage_uncached = _streamed(client, model, second, cache_salt="other")
    assert usage_uncached.prompt_tokens_details.cached_tokens == 0
    assert text == text_uncached, "the cached prefix's KV gives the same greedy tokens"
    print(
        f"TTFT with a cached 1,024-token prefix: {ttft_second * 1e3:.0f} ms vs "
        f"{ttft_first * 1e3:.0f} ms uncached ({ttft_second / ttft_first:.2f} x, cpu)"
    )
