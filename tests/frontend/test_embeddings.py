"""POST /v1/embeddings against the fake engine: input shapes, float and base64, normalization,
Matryoshka dimensions from a checkpoint's sentence-transformers files, the tokenizer's
post-processor, and the 400s that name the field."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import tokenizers
from tokenizers.processors import TemplateProcessing

from gapless.frontend.api.embedding_setup import embedding_setup
from tests.frontend.conftest import MAX_MODEL_LEN, MODEL, build_app
from tests.frontend.fake_engine import FakeEngine, fake_embedding

pytestmark = pytest.mark.anyio


def _unit(ids: list[int]) -> np.ndarray:
    vec = np.frombuffer(fake_embedding(ids), dtype="<f4")
    return vec / np.linalg.norm(vec)


async def test_texts_floats_and_base64(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    texts = ["The capital of France", "is Paris."]
    floats = await client.post("/v1/embeddings", json={"input": texts, "model": MODEL})
    assert floats.status_code == 200, floats.text
    body = floats.json()
    assert body["object"] == "list" and body["model"] == MODEL
    ids = [engine.tokenizer.encode(t).ids for t in texts]
    assert [a.prompt_token_ids for a in engine.added] == ids
    assert all(a.params.pooling == "last" and a.params.max_tokens == 1 for a in engine.added)
    total = sum(map(len, ids))
    assert body["usage"] == {"prompt_tokens": total, "total_tokens": total}
    for i, item in enumerate(body["data"]):
        assert item["object"] == "embedding" and item["index"] == i
        np.testing.assert_allclose(item["embedding"], _unit(ids[i]), rtol=1e-6)
    b64 = await client.post("/v1/embeddings", json={"input": texts, "encoding_format": "base64"})
    for item, want in zip(b64.json()["data"], body["data"], strict=True):
        got = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(got, np.asarray(want["embedding"], dtype=np.float32))


async def test_token_id_inputs(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    one = await client.post("/v1/embeddings", json={"input": [5, 6, 7]})
    assert one.status_code == 200, one.text
    assert len(one.json()["data"]) == 1
    many = await client.post("/v1/embeddings", json={"input": [[5, 6, 7], [8, 9]]})
    assert [a.prompt_token_ids for a in engine.added] == [[5, 6, 7], [5, 6, 7], [8, 9]]
    np.testing.assert_allclose(many.json()["data"][1]["embedding"], _unit([8, 9]), rtol=1e-6)
    assert many.json()["usage"]["prompt_tokens"] == 5


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": ["a", ""]}, "input"),
        ({"input": 12}, "input"),
        ({"input": [1.5, 2.5]}, "input"),
        ({"input": {"text": "a"}}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": [[1], "a", 3]}, "input"),
        ({"input": ["a"] * 2049}, "input"),
        ({"input": "word " * (2 * MAX_MODEL_LEN)}, "input"),
        ({"input": [7] * MAX_MODEL_LEN}, "input"),
        ({"input": [10**9]}, "input"),
        ({}, "input"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "dimensions": 4}, "dimensions"),
    ],
)
async def test_bad_inputs_name_the_field(
    client: httpx.AsyncClient, engine: FakeEngine, body: dict, param: str
) -> None:
    r = await client.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert param in (r.json()["error"]["param"] or "") + r.json()["error"]["message"]
    assert not engine.added


async def test_another_model_is_a_404(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/embeddings", json={"input": "a", "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def _st_model(tmp: Path, modules: list, pooling: dict | None, config: dict) -> Path:
    tmp.mkdir(exist_ok=True)
    (tmp / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (tmp / "1_Pooling").mkdir()
        (tmp / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (tmp / "config.json").write_text(json.dumps(config))
    return tmp


MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
]
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize",
             "type": "sentence_transformers.models.Normalize"}  # fmt: skip


def test_setup_from_sentence_transformers_files(tmp_path: Path) -> None:
    cls = _st_model(tmp_path / "a", MODULES, {"pooling_mode_cls_token": True}, {"hidden_size": 8})
    assert embedding_setup(str(cls)).pooling == "cls"
    assert not embedding_setup(str(cls)).normalize
    assert embedding_setup(str(cls)).matryoshka is None
    mean = _st_model(tmp_path / "b", [*MODULES, NORMALIZE], {"pooling_mode_mean_tokens": True},
                     {"hidden_size": 8, "matryoshka_dimensions": [2, 4, 8]})  # fmt: skip
    setup = embedding_setup(str(mean))
    assert (setup.pooling, setup.normalize, setup.matryoshka) == ("mean", True, (2, 4, 8))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text("{}")
    assert embedding_setup(str(tmp_path / "c")).pooling == "last"
    assert embedding_setup(str(tmp_path / "c")).normalize


async def test_matryoshka_dimensions_truncate_and_renormalize(
    tmp_path: Path, make_config, engine: FakeEngine
) -> None:
    model = _st_model(tmp_path / "a", MODULES, {"pooling_mode_mean_tokens": True},
                      {"hidden_size": 8, "matryoshka_dimensions": [4, 8]})  # fmt: skip
    config = make_config(model_overrides={"path": str(model)})
    app = build_app(config, engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        whole = await c.post("/v1/embeddings", json={"input": [3, 4, 5, 6, 7]})
        cut = await c.post("/v1/embeddings", json={"input": [3, 4, 5, 6, 7], "dimensions": 4})
        bad = await c.post("/v1/embeddings", json={"input": [3, 4], "dimensions": 3})
    assert engine.added[0].params.pooling == "mean"
    raw = np.frombuffer(fake_embedding([3, 4, 5, 6, 7]), dtype="<f4")
    # no Normalize module: the whole vector as pooled
    np.testing.assert_allclose(whole.json()["data"][0]["embedding"], raw, rtol=1e-6)
    got = np.asarray(cut.json()["data"][0]["embedding"])
    np.testing.assert_allclose(got, raw[:4] / np.linalg.norm(raw[:4]), rtol=1e-6)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "dimensions"


async def test_the_tokenizers_post_processor_is_honoured(make_config, engine: FakeEngine) -> None:
    tok = tokenizers.Tokenizer.from_str(engine.tokenizer.to_str())
    tok.post_processor = TemplateProcessing(single="<|im_start|> $A", special_tokens=[
        ("<|im_start|>", 1)])  # fmt: skip
    with_bos = FakeEngine(tok)
    app = build_app(make_config(), with_bos)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.post("/v1/embeddings", json={"input": "hello world"})
    assert r.status_code == 200, r.text
    ids = with_bos.added[0].prompt_token_ids
    assert ids[0] == 1 and ids[1:] == engine.tokenizer.encode("hello world").ids
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
