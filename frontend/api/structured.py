"""Structured output: response_format (and tool schemas) as grammars, checked before a request
reaches the engine.

A grammar is compiled in a worker process (frontend.grammar.pool) with a deadline and a memory
cap, so a pathological schema costs at most the bound and a killed worker, never the frontend's
threads or memory. Verdicts are kept by grammar text in a size-capped cache, and a grammar that
is compiling already is waited for, not compiled again: a repeated schema costs a dict lookup.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import OrderedDict
from typing import Any

import tokenizers

from gapless.common.config import EngineConfig
from gapless.common.grammars import json_grammar
from gapless.frontend.api.protocol import JsonObjectFormat, JsonSchemaFormat, ResponseFormat
from gapless.frontend.api.schema_rules import strict_problem
from gapless.frontend.engine.admission import too_many
from gapless.frontend.grammar.pool import Busy, GrammarPool, Unavailable
from gapless.frontend.grammar.worker import WorkerInit
from gapless.frontend.http.errors import ApiError, bad_request

MAX_CHECKED = 256  # grammars remembered as checked (with their verdict)


class Grammars:
    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        config: EngineConfig,
        executor: object = None,  # unused: compiles run in worker processes, never in it
    ) -> None:
        model = config.model
        init = WorkerInit(
            tokenizer.to_str(),
            model.vocab_size,
            tuple(model.eos_token_ids),
            config.grammar_memory,
        )
        self.pool = GrammarPool(init, config.grammar_workers, config.grammar_timeout_s)
        # why: apps built and dropped (tests) must not leave workers behind
        weakref.finalize(self, self.pool.close)
        self._checked: OrderedDict[str, str] = OrderedDict()  # grammar -> "" or why not
        self._compiling: dict[str, asyncio.Task[str]] = {}

    def warm(self) -> None:
        """Starts the compile workers now (serve), rather than at the first grammar."""
        self.pool.warm()

    def close(self) -> None:
        self.pool.close()

    async def checked(self, grammar: str, param: str, tenant: str = "") -> str:
        """The grammar, once it compiles within the bounds; else a 400 naming param (429 past
        the compile caps, 503 if no compile can run)."""
        why = self._checked.get(grammar)
        if why is None:
            why = await self._verdict(grammar, param, tenant)
        else:
            self._checked.move_to_end(grammar)
        if why:
            raise bad_request(f"{param} cannot be used: {why}", param=param)
        return grammar

    async def _verdict(self, grammar: str, param: str, tenant: str) -> str:
        task = self._compiling.get(grammar)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._compile(grammar, tenant))
            self._compiling[grammar] = task
            task.add_done_callback(lambda _: self._compiling.pop(grammar, None))
        try:
            return await asyncio.shield(task)
        except Busy as exc:
            busy = too_many("grammar_compiles_busy", "requests", f"{param}: {exc}", exc.retry_s)
            raise busy from None
        except Unavailable as exc:
            raise ApiError(503, f"{param} cannot be checked now: {exc}", param=param) from None

    async def _compile(self, grammar: str, tenant: str) -> str:
        why = await self.pool.compile(grammar, tenant)
        self._checked[grammar] = why
        if len(self._checked) > MAX_CHECKED:
            self._checked.popitem(last=False)
        return why

    async def json_schema(self, schema: Any, *, strict: bool, param: str, tenant: str = "") -> str:
        if schema is False:
            raise bad_request(f"{param} is false: no output can match it", param=param)
        if schema is True:
            schema = {}  # any JSON value
        if not isinstance(schema, dict):
            raise bad_request(f"{param} must be a JSON schema object", param=param)
        try:
            problem = strict_problem(schema) if strict else None
            if problem is not None:
                raise bad_request(
                    f"{param} cannot be used: strict: keyword {problem} is not enforced by the "
                    "grammar engine (without strict it is ignored)",
                    param=param,
                )
            grammar = json_grammar(schema, strict=strict)
        except RecursionError:
            raise bad_request(f"{param} is nested too deeply", param=param) from None
        except ValueError as exc:
            raise bad_request(f"{param} cannot be used: {exc}", param=param) from None
        return await self.checked(grammar, param, tenant)

    async def response_format(self, fmt: ResponseFormat | None, tenant: str = "") -> str | None:
        """The grammar a response_format asks for, or None for plain text."""
        if isinstance(fmt, JsonObjectFormat):
            return await self.json_schema(
                {"type": "object"}, strict=True, param="response_format", tenant=tenant
            )
        if isinstance(fmt, JsonSchemaFormat):
            spec = fmt.json_schema
            schema = {"type": "object"} if spec.schema_ is None else spec.schema_
            return await self.json_schema(
                schema,
                strict=bool(spec.strict),
                param="response_format.json_schema.schema",
                tenant=tenant,
            )
        return None
