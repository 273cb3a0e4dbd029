"""`gapless serve --lora-modules` end to end: the official openai client names an adapter as
`model` and gets peft's greedy tokens for it, and the base's under the base's name; the models
list shows the adapter with its parent. An adapter loaded at run time (vLLM's request body,
the admin key, from under --lora-dir) serves peft's tokens too, and after unloading it is a
model that does not exist."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from tests.family_models import build
from tests.lora_adapters import greedy, make_adapter
from tests.server import Server

openai = pytest.importorskip("openai")
pytest.importorskip("peft")

pytestmark = pytest.mark.slow

PROMPT = [1, 2000, 3000, 4000, 5000, 6000, 7000]
TOKENS = 12


def test_the_openai_client_names_an_adapter_as_model(tmp_path, tiny_model_dir):
    base = build("llama", tmp_path / "model", tiny_model_dir)
    ref = make_adapter(base, "llama", tmp_path / "sql", "plain", seed=5)
    fr = make_adapter(base, "llama", tmp_path / "adapters" / "fr", "plain", seed=6)
    keys = {"sk-a": {"tenant": "a", "lora_adapters": ["sql-lora", "fr"]},
            "sk-ops": {"tenant": "ops", "admin": True}}  # fmt: skip
    (tmp_path / "keys.json").write_text(json.dumps(keys))
    server = Server("--model", str(tmp_path / "model"), "--served-model-name", "tiny", "--dtype", "float32",
                    "--lora-modules", f"sql-lora={tmp_path / 'sql'}", "--api-keys-file",
                    str(tmp_path / "keys.json"), "--lora-dir", str(tmp_path / "adapters"))  # fmt: skip
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-a", max_retries=0)
        got = {}
        for name in ("sql-lora", "tiny"):
            reply = client.completions.create(model=name, prompt=PROMPT, max_tokens=TOKENS,
                                              temperature=0, logprobs=0)  # fmt: skip
            assert reply.model == name
            got[name] = (reply.choices[0].text, reply.choices[0].logprobs.token_logprobs)
        cards = {c.id: c.model_extra.get("parent") for c in client.models.list().data}
        assert cards == {"tiny": None, "sql-lora": "tiny"}
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt=PROMPT, max_tokens=1)
        # /v1/responses reads `model` as chat does: the adapter's answer, the same as chat's
        reply = client.responses.create(model="sql-lora", input="hi", max_output_tokens=8,
                                        temperature=0, store=False)  # fmt: skip
        chat = client.chat.completions.create(model="sql-lora", max_tokens=8, temperature=0,
                                              messages=[{"role": "user", "content": "hi"}])  # fmt: skip
        assert reply.model == "sql-lora" and reply.output_text == chat.choices[0].message.content
        got["fr"] = _load_use_unload(server.url, client, tmp_path / "adapters" / "fr")
    finally:
        assert server.stop() == 0, server.read_log()
    tokenizer = Tokenizer.from_file(str(tmp_path / "model" / "tokenizer.json"))
    for name, model in (("sql-lora", ref), ("tiny", base), ("fr", fr)):
        ids, want = greedy(model, PROMPT, TOKENS)
        text, lps = got[name]
        assert text == tokenizer.decode(ids, skip_special_tokens=False), name
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(want), atol=1e-3, rtol=0)
    assert got["sql-lora"][0] != got["tiny"][0]


def _load_use_unload(url: str, client, path) -> tuple[str, list[float]]:
    """Load adapter fr with vLLM's body, complete with it, unload it; its (text, logprobs)."""
    admin = {"authorization": "Bearer sk-ops"}
    body = {"lora_name": "fr", "lora_path": str(path)}
    r = httpx.post(url + "/v1/load_lora_adapter", json=body, headers=admin, timeout=60)
    assert r.status_code == 200, r.text
    assert "fr" in [c.id for c in client.models.list().data]
    reply = client.completions.create(model="fr", prompt=PROMPT, max_tokens=TOKENS,
                                      temperature=0, logprobs=0)  # fmt: skip
    _metrics_count_fr(url)
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "fr"}, headers=admin)
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="fr", prompt=PROMPT, max_tokens=1)
    return reply.choices[0].text, reply.choices[0].logprobs.token_logprobs


def _metrics_count_fr(url: str) -> None:
    """/metrics counts fr's tokens by tenant and shows the info gauge gateways read."""
    deadline = time.monotonic() + 10.0  # why: the core writes its series every few ms
    while True:
        families = {f.name: f.samples for f in
                    text_string_to_metric_families(httpx.get(url + "/metrics").text)}  # fmt: skip
        out = [s for s in families.get("gapless_lora_tokens", [])
               if s.labels.get("adapter") == "fr" and s.labels["kind"] == "output"]  # fmt: skip
        if out or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert [(s.labels["tenant"], s.value) for s in out] == [("a", TOKENS)]
    (info,) = families["gapless_lora_requests_info"]
    assert info.labels["max_lora"] == "1" and info.labels["running_lora_adapters"] == ""
