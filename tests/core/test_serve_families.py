"""`gapless serve --model DIR` for a tiny model of every family answers the openai client,
names the family in its ready line and in /v1/models."""

from __future__ import annotations

import pytest

from tests.family_models import FAMILIES, build
from tests.server import Server

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family", list(FAMILIES))
def test_serve_answers_the_openai_client(family, tmp_path, tiny_model_dir):
    build(family, tmp_path, tiny_model_dir)
    server = Server("--model", str(tmp_path), "--served-model-name", "tiny")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello there"}], max_tokens=8,
            temperature=0,
        )  # fmt: skip
        assert reply.choices[0].finish_reason in ("length", "stop")
        assert reply.usage.completion_tokens >= 1 and reply.choices[0].message.content
        text = client.completions.create(model="tiny", prompt="Once upon", max_tokens=4)
        assert text.usage.completion_tokens == 4
        (card,) = client.models.list().data
        assert card.id == "tiny" and card.model_extra["family"] == family
    finally:
        assert server.stop() == 0, server.read_log()
    ready = [line for line in server.log if "engine ready in" in line]
    assert ready and f": {family}, " in ready[0], server.read_log()
