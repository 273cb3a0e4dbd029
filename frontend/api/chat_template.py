"""The model's chat template, rendered in a jinja2 sandbox with a time and size bound."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import Executor
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gapless.frontend.http.errors import bad_request

_local = threading.local()  # .deadline: time.monotonic() value past which rendering stops


class TemplateTimeout(Exception):
    pass


class TemplateTooLong(Exception):
    pass


def _check_deadline() -> None:
    deadline = getattr(_local, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise TemplateTimeout


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """Checks the render deadline on every call, attribute and item access the template makes,
    so a runaway template stops in its worker thread instead of spinning there forever."""

    def call(self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _check_deadline()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _check_deadline()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _check_deadline()
        return super().getitem(obj, argument)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
    ensure_ascii: bool = False,
) -> str:
    # why: jinja's own tojson escapes HTML characters, which chat templates do not want; the
    # keyword arguments are the ones Hugging Face's renderer passes on to json.dumps
    if separators is not None:
        separators = tuple(separators)  # type: ignore[assignment]
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """Renders `messages` (dicts with role and content, tool_calls) as Hugging Face's
    apply_chat_template does: tools, documents and extra keyword arguments are template
    variables; add_generation_prompt and continue_final_message as there."""

    def __init__(
        self,
        source: str | None,
        *,
        bos_token: str,
        eos_token: str,
        timeout_s: float,
        max_chars: int,
        executor: Executor | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.max_chars = max_chars  # rendered text longer than this is refused
        self._executor = executor
        self._error = "" if source else "the model has no chat template; use /v1/completions"
        self._template: jinja2.Template | None = None
        self.takes_tools = False  # the template renders a `tools` variable itself
        if source:
            env = _BoundedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = _tojson
            env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
            try:
                self._template = env.from_string(source)
                self.takes_tools = "tools" in meta.find_undeclared_variables(env.parse(source))
            except jinja2.TemplateSyntaxError as exc:
                self._error = f"the model's chat template does not compile: {exc}"
        self._context = {"bos_token": bos_token, "eos_token": eos_token}

    async def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        kwargs: dict[str, Any] | None = None,
    ) -> str:
        if self._template is None:
            raise bad_request(self._error, param="messages")
        if continue_final_message and add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true",
                param="continue_final_message",
            )
        # the request's own keyword arguments first, so they cannot replace the named ones
        ctx = dict(kwargs or {})
        ctx.update(self._context)
        ctx.update(
            messages=messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
        )
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.timeout_s
        job = loop.run_in_executor(self._executor, self._render, ctx, deadline)
        try:
            text = await asyncio.wait_for(job, self.timeout_s)
        except (TemplateTimeout, asyncio.TimeoutError):
            raise bad_request(
                f"rendering messages with the chat template took longer than {self.timeout_s} s",
                param="messages",
            ) from None
        except TemplateTooLong:
            raise bad_request(
                f"messages render to more than {self.max_chars} characters, more than the "
                "model accepts",
                param="messages",
                code="context_length_exceeded",
            ) from None
        except Exception as exc:  # why: the template and the messages are both data, not code
            name = "" if isinstance(exc, jinja2.TemplateError) else f"{type(exc).__name__}: "
            raise bad_request(
                f"the chat template failed on these messages: {name}{exc}", param="messages"
            ) from None
        if continue_final_message:
            text = _cut_after_final(text, messages)
        return text

    def _render(self, ctx: dict[str, Any], deadline: float) -> str:
        assert self._template is not None
        _local.deadline = deadline
        try:
            parts, size = [], 0
            for piece in self._template.generate(ctx):
                size += len(piece)
                if size > self.max_chars:
                    raise TemplateTooLong
                _check_deadline()
                parts.append(piece)
            return "".join(parts)
        finally:
            _local.deadline = None


def _cut_after_final(text: str, messages: list[dict[str, Any]]) -> str:
    """The rendered text up to the end of the last message's content, so the model continues
    that message instead of closing it."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip():
        raise bad_request(
            "continue_final_message needs a last message with text content",
            param="continue_final_message",
        )
    at = text.rfind(final.strip())
    if at < 0:
        raise bad_request(
            "the chat template does not render the last message's content as given",
            param="continue_final_message",
        )
    return text[: at + len(final.strip())]
