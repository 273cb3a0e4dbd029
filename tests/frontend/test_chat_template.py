"""Chat templates rendered as Hugging Face renders them, still sandboxed and time-bounded."""

from __future__ import annotations

import asyncio
import json

import pytest

from gapless.frontend.api.chat_template import ChatTemplate
from gapless.frontend.http.errors import ApiError

pytestmark = pytest.mark.anyio
USER = [{"role": "user", "content": "hi"}]


def template(source: str, timeout_s: float = 2.0) -> ChatTemplate:
    return ChatTemplate(
        source, bos_token="<s>", eos_token="</s>", timeout_s=timeout_s, max_chars=10**6
    )


async def test_loopcontrols_and_tojson_keywords() -> None:
    t = template(
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{{ m | tojson(indent=2, sort_keys=true) }}{% endfor %}"
        "|{{ {'b': 1, 'a': 'é'} | tojson(separators=(',', ':'), ensure_ascii=true) }}"
    )
    text = await t.render([{"role": "user", "content": "x"}, {"role": "user", "content": "y"}])
    first, second = text.split("|")
    assert json.loads(first) == {"role": "user", "content": "x"} and "\n  " in first
    assert second == '{"b":1,"a":"\\u00e9"}'


async def test_raise_exception_is_a_400() -> None:
    t = template("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ApiError) as exc:
        await t.render(USER)
    assert exc.value.status == 400 and "roles must alternate" in exc.value.message


async def test_strftime_now_and_extra_variables() -> None:
    t = template(
        "{{ strftime_now('%Y') }}|{{ tools | length }}|{{ documents[0].title }}|{{ flavour }}"
        "|{{ add_generation_prompt }}"
    )
    text = await t.render(
        USER,
        tools=[{"type": "function", "function": {"name": "f"}}],
        documents=[{"title": "doc"}],
        kwargs={"flavour": "mint", "messages": "ignored"},
        add_generation_prompt=False,
    )
    year, tools, title, flavour, gen = text.split("|")
    assert year.isdigit() and tools == "1" and title == "doc" and flavour == "mint"
    assert gen == "False"
    assert t.takes_tools


async def test_continue_final_message_cuts_after_its_content() -> None:
    t = template(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    messages = [*USER, {"role": "assistant", "content": "The answer is"}]
    text = await t.render(messages, add_generation_prompt=False, continue_final_message=True)
    assert text == "<user>hi</user><assistant>The answer is"
    with pytest.raises(ApiError):
        await t.render(messages, add_generation_prompt=True, continue_final_message=True)


async def test_still_sandboxed_and_bounded() -> None:
    with pytest.raises(ApiError):  # no attribute escapes to Python internals
        await template("{{ messages.__class__.__mro__ }}").render(USER)
    slow = template(
        "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
        timeout_s=0.2,
    )
    with pytest.raises(ApiError) as exc:
        await asyncio.wait_for(slow.render(USER), 5)
    assert exc.value.status == 400


async def test_chat_template_file_overrides_the_models(make_config, engine, tmp_path) -> None:
    import httpx

    from tests.frontend.conftest import build_app

    path = tmp_path / "t.jinja"
    path.write_text("CUSTOM {% for m in messages %}{{ m.content }}{% endfor %}")
    app = build_app(make_config(chat_template=str(path)), engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1})
    assert r.status_code == 200
    assert engine.tokenizer.decode(engine.added[0].prompt_token_ids) == "CUSTOM hi"
