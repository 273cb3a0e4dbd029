"""Chat templates in the style of each family render with that family's own special tokens,
each one id after tokenizing (tool calls included where the template has them), and the
family's end-of-turn token is among the stop ids."""

from __future__ import annotations

import json

import pytest
from tokenizers import AddedToken, Tokenizer

from gapless.frontend.api.prompts import Prompter
from tests.engine_harness import make_config
from tests.family_models import build

pytest.importorskip("transformers")
pytestmark = pytest.mark.anyio

GEMMA = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m.role == 'assistant' else m.role }}\n{{ m.content }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
QWEN3 = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "</tools><|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>\n{{ c.function | tojson }}\n"
    "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} "
    "[/INST]{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"
)
PHI3 = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# family -> (template, its special tokens, bos, the end-of-turn token, generation_config eos)
TEMPLATES = {
    "gemma2": (GEMMA, ["<start_of_turn>", "<end_of_turn>", "<bos>"], "<bos>", "<end_of_turn>"),
    "qwen3": (QWEN3, ["<tool_call>", "</tool_call>", "<think>", "</think>"], None, "<|im_end|>"),
    "mistral": (MISTRAL, ["[INST]", "[/INST]", "<s>", "</s>"], "<s>", "</s>"),
    "phi3": (PHI3, ["<|user|>", "<|assistant|>", "<|end|>"], None, "<|end|>"),
}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
MESSAGES = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "weather",
                                                       "arguments": {"city": "Paris"}}}]},
    {"role": "user", "content": "Thanks"},
]  # fmt: skip


@pytest.mark.parametrize("family", list(TEMPLATES))
async def test_a_family_template_renders_its_special_tokens(family, tmp_path, tiny_model_dir):
    template, specials, bos, end = TEMPLATES[family]
    build(family, tmp_path, tiny_model_dir)
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(str(tmp_path / "tokenizer.json"))
    tok_config = {"chat_template": template, "eos_token": end, "add_bos_token": False}
    if bos:
        tok_config["bos_token"] = bos
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    end_id = tok.token_to_id(end)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, end_id]}))
    config = make_config(tmp_path)
    assert end_id in config.model.eos_token_ids
    prompter = Prompter(tok, config)
    ids = await prompter.chat_ids(MESSAGES, tools=TOOLS)
    text = prompter.decode(ids)
    for token in specials:
        if token in text:
            assert tok.token_to_id(token) in ids, f"{token} is one id"
    used = [t for t in specials if t in text]
    assert len(used) >= 2, f"the template used the family's tokens: {text!r}"
    if family == "qwen3":
        assert '<tool_call>\n{"name": "weather"' in text and "<tools>" in text
    assert tok.decode(ids, skip_special_tokens=False) == text
