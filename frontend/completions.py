"""POST /v1/completions."""

from __future__ import annotations

import time
import uuid

import msgspec

from gapless.core.common.messages import TextDelta
from gapless.frontend.asgi import HttpRequest, Responder, encoder
from gapless.frontend.errors import bad_request, decode_body
from gapless.frontend.generation import ChoiceResult, Job, respond
from gapless.frontend.params import (
    check_cache_salt,
    check_logprobs,
    check_max_tokens,
    check_model,
    check_n,
    per_choice,
    resolve_max_tokens,
    sampling_params,
)
from gapless.frontend.protocol import CompletionRequest
from gapless.frontend.responses import Completion, CompletionChoice, Usage, completion_logprobs
from gapless.frontend.state import FrontendState
from gapless.frontend.tenants import Caller, priority_of, tenant_of

_decoder = msgspec.json.Decoder(CompletionRequest)


class CompletionChunks:
    """`text_completion` stream chunks; text_offset runs on per choice."""

    def __init__(self, response_id: str, created: int, model: str, n: int, logprobs: bool) -> None:
        self._head = (response_id, created, model)
        self._logprobs = logprobs
        self._offsets = [0] * n  # characters sent so far, per choice

    def opening(self, index: int) -> bytes | None:
        return None

    def delta(self, index: int, delta: TextDelta) -> bytes:
        logprobs = None
        if self._logprobs:
            logprobs = completion_logprobs(delta.logprobs or [], self._offsets[index])
        self._offsets[index] += len(delta.text)
        choice = CompletionChoice(index, delta.text, logprobs, delta.finish_reason)
        return encoder.encode(self._chunk([choice]))

    def usage(self, usage: Usage) -> bytes:
        return encoder.encode(self._chunk([], usage))

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
    check_model(body.model, config)
    if body.echo:
        raise bad_request("echo is not supported", param="echo")
    n = check_n(body.n, config)
    max_tokens = check_max_tokens(body.max_tokens, "max_tokens", config)
    logprobs = check_logprobs(body.logprobs, "logprobs", config)
    base = sampling_params(body, 1, logprobs, config)
    tenant = tenant_of(caller, req.headers.get("x-tenant"), body.user)
    priority = priority_of(body.priority, tenant, config)
    salt = check_cache_salt(body.cache_salt)
    response_id, created, model = f"cmpl-{uuid.uuid4().hex}", int(arrival), config.served_model_name

    def build(choices: list[ChoiceResult], usage: Usage) -> Completion:
        out_choices = [
            CompletionChoice(
                index=i,
                text=c.text,
                logprobs=completion_logprobs(c.logprobs, 0) if logprobs is not None else None,
                finish_reason=c.finish_reason,
            )
            for i, c in enumerate(choices)
        ]
        return Completion(
            id=response_id, created=created, model=model, choices=out_choices, usage=usage
        )

    # admission (README, "Admission control"): the request caps before tokenizing, the token
    # cap after; the ticket counts the request as queued until its choices start
    with state.admission.admit(tenant, n, received) as ticket:
        prompt_ids = await state.prompter.completion_ids(body.prompt)
        budget = resolve_max_tokens(max_tokens, "max_tokens", len(prompt_ids), "prompt", config)
        state.admission.admit_tokens(ticket, len(prompt_ids), received)
        params = per_choice(msgspec.structs.replace(base, max_tokens=budget), n)
        rid = state.engine.next_request_id()
        job = Job(
            "completions",
            rid,
            prompt_ids,
            params,
            tenant,
            priority,
            arrival,
            ticket,
            cache_salt=salt,
        )
        await respond(
            state,
            job,
            req,
            out,
            streaming=bool(body.stream),
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            fmt=CompletionChunks(response_id, created, model, n, logprobs is not None),
            build=build,
        )
