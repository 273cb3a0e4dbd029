"""The default model, SmolLM2-135M-Instruct from its GGUF, through the server and the openai
client, against transformers' greedy generation on the same file in fp32."""

from __future__ import annotations

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
