"""Structured output: response_format (and tool schemas) as grammars, checked before a request
reaches the engine.

Compiling runs in the executor with a time bound, and what was checked is kept in a size-capped
cache, so a repeated schema costs a dict lookup and a pathological one costs at most the bound
(llguidance's parser limits also cap the work itself, core/common/grammars.py).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from concurrent.futures import Executor
from typing import Any

import llguidance
import tokenizers

from gapless.core.common.config import EngineConfig
from gapless.core.common.grammars import check_grammar, json_grammar, make_tokenizer
from gapless.frontend.errors import bad_request
from gapless.frontend.protocol import JsonObjectFormat, JsonSchemaFormat, ResponseFormat

MAX_CHECKED = 256  # grammars remembered as checked (with their verdict)
COMPILE_TIMEOUT_S = 5.0


class Grammars:
    def __init__(
        self, tokenizer: tokenizers.Tokenizer, config: EngineConfig, executor: Executor | None
    ) -> None:
        self._tokenizer_json = tokenizer.to_str()
        self._config = config
        self._executor = executor
        self._view: llguidance.LLTokenizer | None = None
        self._checked: OrderedDict[str, str] = OrderedDict()  # grammar -> "" or why not
        self.timeout_s = COMPILE_TIMEOUT_S

    def _tokenizer(self) -> llguidance.LLTokenizer:
        if self._view is None:
            model = self._config.model
            self._view = make_tokenizer(
                self._tokenizer_json, model.vocab_size, tuple(model.eos_token_ids)
            )
        return self._view

    def _check(self, grammar: str) -> str:
        return check_grammar(grammar, self._tokenizer())

    async def checked(self, grammar: str, param: str) -> str:
        """The grammar, once it compiles within the bound; else a 400 naming param."""
        why = self._checked.get(grammar)
        if why is None:
            loop = asyncio.get_running_loop()
            job = loop.run_in_executor(self._executor, self._check, grammar)
            try:
                why = await asyncio.wait_for(job, self.timeout_s)
            except asyncio.TimeoutError:
                why = f"it did not compile within {self.timeout_s} s"
            self._checked[grammar] = why
            if len(self._checked) > MAX_CHECKED:
                self._checked.popitem(last=False)
        else:
            self._checked.move_to_end(grammar)
        if why:
            raise bad_request(f"{param} cannot be used: {why}", param=param)
        return grammar

    async def json_schema(self, schema: Any, *, strict: bool, param: str) -> str:
        if not isinstance(schema, (dict, bool)):
            raise bad_request(f"{param} must be a JSON schema object", param=param)
        try:
            grammar = json_grammar(schema, strict=strict)
        except ValueError as exc:
            raise bad_request(f"{param} cannot be used: {exc}", param=param) from None
        return await self.checked(grammar, param)

    async def response_format(self, fmt: ResponseFormat | None) -> str | None:
        """The grammar a response_format asks for, or None for plain text."""
        if isinstance(fmt, JsonObjectFormat):
            return await self.json_schema({"type": "object"}, strict=True, param="response_format")
        if isinstance(fmt, JsonSchemaFormat):
            spec = fmt.json_schema
            schema = {"type": "object"} if spec.schema_ is None else spec.schema_
            return await self.json_schema(
                schema, strict=bool(spec.strict), param="response_format.json_schema.schema"
            )
        return None
