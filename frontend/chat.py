"""POST /v1/chat/completions."""

from __future__ import annotations

import time
import uuid

import msgspec

from gapless.core.common.config import EngineConfig
from gapless.core.common.messages import TextDelta
from gapless.frontend.asgi import HttpRequest, Responder, encoder
from gapless.frontend.errors import bad_request, from_decode_error
from gapless.frontend.generation import ChoiceResult, Job, respond
from gapless.frontend.openai_fields import CHAT_REFUSED, check_fields, struct_fields
from gapless.frontend.params import (
    check_logprobs,
    check_max_tokens,
    check_min_tokens,
    check_model,
    check_n,
    per_choice,
    resolve_max_tokens,
    sampling_params,
)
from gapless.frontend.protocol import ChatCompletionRequest
from gapless.frontend.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    Usage,
    chat_logprobs,
)
from gapless.frontend.state import FrontendState
from gapless.frontend.tenants import Caller, priority_of, tenant_of

_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_KNOWN = struct_fields(ChatCompletionRequest)


class ChatChunks:
    """`chat.completion.chunk`s: each choice opens with the assistant role and empty content."""

    def __init__(self, response_id: str, created: int, model: str, logprobs: bool) -> None:
        self._head = (response_id, created, model)
        self._logprobs = logprobs

    def opening(self, index: int, first: TextDelta) -> bytes | None:
        return self._encode([ChatChunkChoice(index, ChatDelta(role="assistant", content=""))])

    def delta(self, index: int, delta: TextDelta) -> bytes:
        logprobs = chat_logprobs(delta.logprobs or []) if self._logprobs else None
        content = delta.text if delta.text or delta.finish_reason is None else None
        choice = ChatChunkChoice(index, ChatDelta(content=content), logprobs, delta.finish_reason)
        return self._encode([choice])

    def usage(self, usage: Usage) -> bytes:
        return self._encode([], usage)

    def _encode(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
        rid, created, model = self._head
        chunk = ChatCompletionChunk(
            id=rid, created=created, model=model, choices=choices, usage=usage
        )
        return encoder.encode(chunk)


def _logprobs(body: ChatCompletionRequest, config: EngineConfig) -> int | None:
    """SamplingParams.logprobs: None, or how many alternatives to return with each token."""
    if not body.logprobs:
        if body.top_logprobs is not None:
            raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
        return None
    return check_logprobs(body.top_logprobs or 0, "top_logprobs", config)


async def handle_chat(
    state: FrontendState, req: HttpRequest, out: Responder, caller: Caller
) -> None:
    arrival = time.time()
    config = state.config
    try:
        raw = await req.body(config.max_body_bytes)
        received = time.perf_counter()  # the whole request is here: admission's clock starts
        body = _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise from_decode_error(exc) from None
    check_fields(raw, "chat", _KNOWN, CHAT_REFUSED)
    check_model(body.model, config)
    n = check_n(body.n, config)
    budget_name = (
        "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    )
    max_tokens = check_max_tokens(
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
        budget_name,
        config,
    )
    logprobs = _logprobs(body, config)
    bad_words = await state.prompter.bad_words_ids(body.bad_words)
    base = sampling_params(body, 1, logprobs, config, bad_words)
    grammar = await state.prompter.grammars.response_format(body.response_format)
    if grammar is not None:
        base = msgspec.structs.replace(base, grammar=grammar)
    tenant = tenant_of(caller, req.headers.get("x-tenant"), body.user)
    priority = priority_of(body.priority, tenant, config)
    response_id, created, model = (
        f"chatcmpl-{uuid.uuid4().hex}",
        int(arrival),
        config.served_model_name,
    )

    def build(choices: list[ChoiceResult], usage: Usage) -> ChatCompletion:
        out_choices = [
            ChatChoice(
                index=i,
                message=AssistantMessage(c.text),
                logprobs=chat_logprobs(c.logprobs) if logprobs is not None else None,
                finish_reason=c.finish_reason,
            )
            for i, c in enumerate(choices)
        ]
        return ChatCompletion(
            id=response_id, created=created, model=model, choices=out_choices, usage=usage
        )

    # admission (README, "Admission control"): the request caps before the chat template and
    # tokenizing, the token cap after; the ticket counts the request until its choices start
    with state.admission.admit(tenant, n, received) as ticket:
        prompt_ids = await state.prompter.chat_ids(body.messages)
        budget = resolve_max_tokens(max_tokens, budget_name, len(prompt_ids), "messages", config)
        check_min_tokens(base, budget, budget_name)
        state.admission.admit_tokens(ticket, len(prompt_ids), received)
        params = per_choice(msgspec.structs.replace(base, max_tokens=budget), n)
        rid = state.engine.next_request_id()
        job = Job("chat", rid, [prompt_ids] * n, params, tenant, priority, arrival, ticket)
        await respond(
            state,
            job,
            req,
            out,
            streaming=bool(body.stream),
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            fmt=ChatChunks(response_id, created, model, logprobs is not None),
            build=build,
        )
