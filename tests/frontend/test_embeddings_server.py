"""The official openai client's `embeddings.create` against a real `gapless serve` on a tiny
random Qwen3 with sentence-transformers files (mean pooling, normalized) and a tokenizer whose
post-processor adds a BOS token: its vectors equal transformers' on the same weights, base64
(the client's default) and float alike, batched and alone."""

from __future__ import annotations

import json

import numpy as np
import openai
import pytest
import tokenizers
import torch
from tokenizers.processors import TemplateProcessing

from tests.family_models import build
from tests.server import Server

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")

TEXTS = ["The capital of France is Paris.", "Queues grow when the device waits for Python."]


@pytest.fixture(scope="module")
def model(tmp_path_factory, tiny_model_dir):
    """(model directory, transformers' model, its tokenizer with the BOS post-processor)."""
    out = tmp_path_factory.mktemp("st-qwen3")
    ref = build("qwen3", out, tiny_model_dir)
    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.post_processor = TemplateProcessing(single="<|im_start|> $A", special_tokens=[
        ("<|im_start|>", 1)])  # fmt: skip
    tok.save(str(out / "tokenizer.json"))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]  # fmt: skip
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return out, ref, tok


@pytest.fixture(scope="module")
def client(model):
    s = Server("--model", str(model[0]), "--dtype", "float32", "--served-model-name", "tiny",
               "--max-model-len", "512")  # fmt: skip
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert s.stop() == 0, s.read_log()


def _want(model, text: str) -> np.ndarray:
    _, ref, tok = model
    ids = tok.encode(text).ids
    assert ids[0] == 1, "the post-processor adds BOS"
    with torch.no_grad():
        vec = ref.model(torch.tensor([ids])).last_hidden_state[0].mean(0).numpy()
    return vec / np.linalg.norm(vec)


def test_vectors_equal_transformers_base64_and_float(client, model):
    b64 = client.embeddings.create(model="tiny", input=TEXTS)  # the client asks for base64
    floats = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    alone = client.embeddings.create(model="tiny", input=TEXTS[1])
    want = [_want(model, t) for t in TEXTS]
    assert b64.usage.prompt_tokens == sum(len(model[2].encode(t).ids) for t in TEXTS)
    for i, w in enumerate(want):
        got = np.asarray(b64.data[i].embedding)
        assert got.shape == w.shape and float(got @ w) >= 0.9999
        np.testing.assert_allclose(floats.data[i].embedding, got, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(alone.data[0].embedding, b64.data[1].embedding, atol=1e-6)


def test_bad_input_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="tiny", input=[])
    assert err.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="tiny", input="a", dimensions=8)
    assert err.value.body["param"] == "dimensions"
