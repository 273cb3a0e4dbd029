"""POST /v1/completions."""

from __future__ import annotations

import time
import uuid

import msgspec

from gapless.common.messages import TextDelta
from gapless.frontend.asgi import HttpRequest, Responder, encoder
from gapless.frontend.errors import decode_body
from gapless.frontend.generation import ChoiceResult, Job, respond
from gapless.frontend.openai_fields import COMPLETION_REFUSED, check_fields, struct_fields
from gapless.frontend.params import (
    check_cache_salt,
    check_logprobs,
    check_max_tokens,
    check_min_tokens,
    check_model,
    check_n,
    per_choice,
    resolve_max_tokens,
    sampling_params,
)
from gapless.frontend.prompts import CompletionPrompt
from gapless.frontend.protocol import CompletionRequest
from gapless.frontend.responses import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    Usage,
    completion_logprobs,
)
from gapless.frontend.state import FrontendState
from gapless.frontend.tenants import Caller, cache_scope_of, priority_of, tenant_of

_decoder = msgspec.json.Decoder(CompletionRequest)


DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_KNOWN = struct_fields(CompletionRequest)


class CompletionChunks:
    """`text_completion` stream chunks; text_offset runs on per choice. With echo, each
    choice opens with its prompt's text."""

    def __init__(
        self,
        response_id: str,
        created: int,
        model: str,
        n: int,
        logprobs: bool,
        echoed: list[str] | None = None,
        first_tokens: list[str] | None = None,
    ) -> None:
        self._head = (response_id, created, model)
        self._logprobs = logprobs
        self._offsets = [0] * n  # characters sent so far, per choice
        self._echoed = echoed  # per choice: the prompt text sent first
        self._first_tokens = first_tokens  # per choice: the prompt's first token, with logprobs
        # per choice: a text-only chunk's bytes around its text (ChatChunks._split says why)
        self._around: list[tuple[bytes, bytes] | None] = [None] * n

    def opening(self, index: int, first: TextDelta) -> bytes | None:
        if self._echoed is None:
            return None
        text = self._echoed[index]
        logprobs = None
        if self._logprobs and self._first_tokens is not None:
            items = first.prompt_logprobs or []
            logprobs = completion_logprobs(items, 0, self._first_tokens[index])
        self._offsets[index] = len(text)
        return encoder.encode(self._chunk([CompletionChoice(index, text, logprobs)]))

    def plain(self, index: int, delta: TextDelta) -> bytes | None:
        if self._logprobs or delta.finish_reason is not None:
            return None
        around = self._around[index] or self._split(index)
        return around[0] + encoder.encode(delta.text) + around[1]

    def delta(self, index: int, delta: TextDelta) -> bytes:
        if (chunk := self.plain(index, delta)) is not None:  # the usual chunk: text only
            return chunk
        logprobs = None
        if self._logprobs:
            logprobs = completion_logprobs(delta.logprobs or [], self._offsets[index])
        self._offsets[index] += len(delta.text)
        choice = CompletionChoice(index, delta.text, logprobs, delta.finish_reason)
        return encoder.encode(self._chunk([choice]))

    def usage(self, usage: Usage) -> bytes:
        return encoder.encode(self._chunk([], usage))

    def _split(self, index: int) -> tuple[bytes, bytes]:
        whole = encoder.encode(self._chunk([CompletionChoice(index, "")]))
        head, marker, tail = whole.rpartition(b'"text":""')
        assert marker, whole
        self._around[index] = around = (head + b'"text":', tail)
        return around

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> Completion:
        rid, created, model = self._head
        return Completion(id=rid, created=created, model=model, choices=choices, usage=usage)


async def handle_completions(
    state: FrontendState, req: HttpRequest, out: Responder, caller: Caller
) -> None:
    arrival = time.time()
    config = state.config
    raw = await req.body(config.max_body_bytes)
    received = time.perf_counter()  # the whole request is here: admission's clock starts
    body = decode_body(_decoder, raw)
    check_fields(raw, "completions", _KNOWN, COMPLETION_REFUSED)
    check_model(body.model, config)
    n = check_n(body.n, config)
    if body.max_tokens is None:
        body.max_tokens = DEFAULT_MAX_TOKENS
    max_tokens = check_max_tokens(body.max_tokens, "max_tokens", config)
    logprobs = check_logprobs(body.logprobs, "logprobs", config)
    bad_words = await state.prompter.bad_words_ids(body.bad_words)
    base = sampling_params(body, 1, logprobs, config, bad_words)
    if body.echo and logprobs is not None:
        base = msgspec.structs.replace(base, prompt_logprobs=logprobs)
    tenant = tenant_of(caller, req.headers.get("x-tenant"), body.user)
    priority = priority_of(body.priority, tenant, config)
    salt = cache_scope_of(tenant, check_cache_salt(body.cache_salt), config)
    response_id, created, model = f"cmpl-{uuid.uuid4().hex}", int(arrival), config.served_model_name

    echoed: list[str] | None = None
    first_tokens: list[str] | None = None

    def choice_logprobs(i: int, c: ChoiceResult) -> CompletionLogprobs | None:
        if logprobs is None:
            return None
        if echoed is None or first_tokens is None:
            return completion_logprobs(c.logprobs, 0)
        items = (c.prompt_logprobs or []) + c.logprobs
        return completion_logprobs(items, 0, first_tokens[i])

    def build(choices: list[ChoiceResult], usage: Usage) -> Completion:
        out_choices = [
            CompletionChoice(
                index=i,
                text=c.text if echoed is None else echoed[i] + c.text,
                logprobs=choice_logprobs(i, c),
                finish_reason=c.finish_reason,
            )
            for i, c in enumerate(choices)
        ]
        return Completion(
            id=response_id, created=created, model=model, choices=out_choices, usage=usage
        )

    # admission (README, "Admission control"): the request caps before tokenizing, the token
    # cap after; the ticket counts the request as queued until its choices start
    num_prompts = len(body.prompt) if _is_batch(body.prompt) else 1
    with state.admission.admit(tenant, n * num_prompts, received) as ticket:
        prompts = await state.prompter.completion_prompts(body.prompt)
        params, choice_prompts = [], []
        for prompt_ids in prompts:
            budget = resolve_max_tokens(max_tokens, "max_tokens", len(prompt_ids), "prompt", config)
            check_min_tokens(base, budget, "max_tokens")
            params += per_choice(msgspec.structs.replace(base, max_tokens=budget), n)
            choice_prompts += [prompt_ids] * n
        num_prompt_tokens = sum(len(p) for p in prompts)
        state.admission.admit_tokens(ticket, num_prompt_tokens, received)
        if body.echo:
            texts = _prompt_texts(body.prompt, prompts, state)
            echoed = [texts[i // n] for i in range(len(params))]
            firsts = [state.prompter.decode(p[:1]) for p in prompts]
            first_tokens = [firsts[i // n] for i in range(len(params))]
        rid = state.engine.next_request_id()
        job = Job(
            "completions",
            rid,
            choice_prompts,
            params,
            tenant,
            priority,
            arrival,
            ticket,
            cache_salt=salt,
            num_prompt_tokens=num_prompt_tokens,
        )
        await respond(
            state,
            job,
            req,
            out,
            streaming=bool(body.stream),
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            fmt=CompletionChunks(
                response_id,
                created,
                model,
                len(params),
                logprobs is not None,
                echoed,
                first_tokens,
            ),
            build=build,
        )


def _is_batch(prompt: CompletionPrompt) -> bool:
    """A list of prompts (strings or token-id lists), not one prompt of token ids."""
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)


def _prompt_texts(
    prompt: CompletionPrompt, ids: list[list[int]], state: FrontendState
) -> list[str]:
    """Each prompt's text as echoed: text prompts as given, token ids decoded."""
    given = prompt if _is_batch(prompt) else [prompt]
    return [
        p if isinstance(p, str) else state.prompter.decode(i)
        for p, i in zip(given, ids, strict=True)
    ]
