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
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gapless.frontend.errors import bad_request

_local = threading.local()  # .deadline: time.monotonic() value past which rendering stops


class TemplateTimeout(Exception):
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


def _tojson(value: Any, indent: int | None = None) -> str:
    # why: jinja's own tojson escapes HTML characters, which chat templates do not want
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """Renders `messages` (dicts with role and content) with add_generation_prompt=True."""

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
        if source:
            env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = _tojson
            env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
            try:
                self._template = env.from_string(source)
            except jinja2.TemplateSyntaxError as exc:
                self._error = f"the model's chat template does not compile: {exc}"
        self._context = {"bos_token": bos_token, "eos_token": eos_token}

    async def render(self, messages: list[dict[str, Any]]) -> str:
        if self._template is None:
            raise bad_request(self._error, param="messages")
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.timeout_s
        job = loop.run_in_executor(self._executor, self._render, messages, deadline)
        try:
            return await asyncio.wait_for(job, self.timeout_s)
        except (TemplateTimeout, asyncio.TimeoutError):
            raise bad_request(
                f"rendering messages with the chat template took longer than {self.timeout_s} s",
                param="messages",
            ) from None
        except Exception as exc:  # why: the template and the messages are both data, not code
            name = "" if isinstance(exc, jinja2.TemplateError) else f"{type(exc).__name__}: "
            raise bad_request(
                f"the chat template failed on these messages: {name}{exc}", param="messages"
            ) from None

    def _render(self, messages: list[dict[str, Any]], deadline: float) -> str:
        assert self._template is not None
        _local.deadline = deadline
        try:
            parts, size = [], 0
            ctx = dict(self._context, messages=messages, add_generation_prompt=True)
            for piece in self._template.generate(ctx):
                size += len(piece)
                if size > self.max_chars:
                    raise jinja2.TemplateError(
                        f"the rendered prompt is longer than {self.max_chars} characters"
                    )
                _check_deadline()
                parts.append(piece)
            return "".join(parts)
        finally:
            _local.deadline = None
