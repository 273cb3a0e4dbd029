"""POST /v1/responses: the Responses API over the chat route's generation path.

The request is read into the chat route's terms (frontend.api.responses_input): its items, with
a stored response's context and output first when it names a `previous_response_id`, become
chat messages, the instructions a system message before them; then the chat template, the
sampling checks, admission, tenants, the grammars of `text.format` and of forced tools, and the
tool-call parser run as they do for chat. docs/responses.md says what each field does.
"""

from __future__ import annotations

import secrets
import time
from contextlib import aclosing
from functools import partial
from typing import Any

import msgspec

from gapless.common.config import EngineConfig
from gapless.frontend.api.generation import ChoiceResult, cut_error
from gapless.frontend.api.openai_fields import RESPONSES_REFUSED, check_fields, struct_fields
from gapless.frontend.api.params import check_adapter_model, check_max_tokens, sampling_fields
from gapless.frontend.api.prelude import Prelude, Route
from gapless.frontend.api.protocol import (
    ChatCompletionRequest,
    JsonObjectFormat,
    JsonSchemaFormat,
    ResponseFormat,
)
from gapless.frontend.api.replies import Usage
from gapless.frontend.api.responses_events import ResponseEvents, output_items
from gapless.frontend.api.responses_input import (
    Item,
    chat_messages,
    chat_tool_choice,
    chat_tools,
    input_items,
    response_format,
    text_config,
)
from gapless.frontend.api.responses_protocol import ResponsesRequest
from gapless.frontend.api.responses_store import ResponseStore
from gapless.frontend.api.state import FrontendState
from gapless.frontend.api.stream import RequestStream
from gapless.frontend.api.structured import Grammars
from gapless.frontend.api.tool_parsers import make_parser
from gapless.frontend.api.tools import plan_tools, template_messages
from gapless.frontend.engine.client import StreamCut
from gapless.frontend.engine.tenants import Caller, tenant_of
from gapless.frontend.http import metrics
from gapless.frontend.http.asgi import HttpRequest, Responder
from gapless.frontend.http.errors import ApiError, bad_request, decode_body

_decoder = msgspec.json.Decoder(ResponsesRequest)
_KNOWN = struct_fields(ResponsesRequest)
MAX_TRUNCATIONS = 64  # items truncation "auto" drops, at most, before the context error stands


def _budget(body: ChatCompletionRequest) -> tuple[int | None, str]:
    return body.max_completion_tokens, "max_output_tokens"


ROUTE = Route("responses", ChatCompletionRequest, RESPONSES_REFUSED, "resp", _budget,
              lambda body, config: None)  # fmt: skip


def response_id() -> str:
    """`resp_` and 192 random bits."""
    return "resp_" + secrets.token_hex(24)


def not_found(rid: str) -> ApiError:
    return ApiError(
        404, f"no response with id {rid!r} is stored", param="response_id", code="not_found"
    )


async def previous_context(store: ResponseStore | None, rid: str | None, tenant: str) -> list[Item]:
    """The items a continued response stands on: its context, then its output."""
    if rid is None:
        return []
    if store is None:
        raise bad_request(
            "previous_response_id needs stored responses, and this server keeps none "
            "(--responses-store none)",
            param="previous_response_id",
        )
    stored = await store.get(rid, tenant)
    if stored is None:
        raise ApiError(
            404,
            f"previous_response_id: no response with id {rid!r} is stored",
            param="previous_response_id",
            code="not_found",
        )
    return [*stored.context, *stored.response["output"]]


def _check_unsupported(body: ResponsesRequest) -> None:
    """400 naming a decoded field whose value gapless cannot honour."""
    why = None
    if body.reasoning is not None and body.reasoning.effort not in (None, "none"):
        why = "reasoning", "the served model takes no reasoning effort"
    elif body.top_logprobs:
        why = "top_logprobs", "logprobs are not returned by /v1/responses"
    elif "message.output_text.logprobs" in (body.include or ()):
        why = "include", "logprobs are not returned by /v1/responses"
    if why is not None:
        raise bad_request(f"{why[0]}: {why[1]}", param=why[0], code="unsupported_field")


def chat_request(body: ResponsesRequest, items: list[Item]) -> ChatCompletionRequest:
    return ChatCompletionRequest(
        messages=chat_messages(items, body.instructions),
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        tools=chat_tools(body.tools),
        tool_choice=chat_tool_choice(body),
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=response_format(body.text),
        user=body.user,
        stream=body.stream,
        seed=body.seed,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        stop=body.stop,
        logit_bias=body.logit_bias,
        ignore_eos=body.ignore_eos,
        priority=body.priority,
        cache_salt=body.cache_salt,
    )


def _usage(usage: Usage) -> dict[str, Any]:
    details = usage.prompt_tokens_details
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": details.cached_tokens if details else 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


class Answer:
    """The response object of one request, as it is before, during and after generation."""

    def __init__(self, pre: Prelude[Any], body: ResponsesRequest, keep: bool) -> None:
        sampling = pre.sampling
        self.head: dict[str, Any] = {
            "id": pre.response_id,
            "object": "response",
            "created_at": pre.created,
            "status": "in_progress",
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": None,
            "model": pre.model,
            "output": [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "service_tier": "default",
            "store": keep,
            "temperature": sampling["temperature"],
            "text": text_config(body.text),
            "tool_choice": _tool_choice(body),
            "tools": [_tool(t) for t in body.tools or ()],
            "top_p": sampling["top_p"],
            "truncation": body.truncation or "disabled",
            "usage": None,
            "user": body.user,
            "metadata": body.metadata or {},
        }

    def done(self, output: list[Item], reason: str | None, usage: Usage) -> dict[str, Any]:
        cut = reason == "length"
        return {
            **self.head,
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "output": output,
            "usage": _usage(usage),
        }

    def failed(self, error: ApiError) -> dict[str, Any]:
        return {
            **self.head,
            "status": "failed",
            "error": {"code": error.code or "server_error", "message": error.message},
        }


def _tool_choice(body: ResponsesRequest) -> Any:
    choice = body.tool_choice
    if choice is None:
        return "auto" if body.tools else "none"
    return choice if isinstance(choice, str) else {"type": "function", "name": choice.name}


def _tool(tool: Any) -> dict[str, Any]:
    out = msgspec.to_builtins(tool)
    out["strict"] = True if tool.strict is None else tool.strict
    return out


async def handle_responses(
    state: FrontendState, req: HttpRequest, out: Responder, caller: Caller
) -> None:
    arrival = time.time()
    config = state.config
    raw = await req.body(config.max_body_bytes)
    received = time.perf_counter()
    body = decode_body(_decoder, raw)
    check_fields(raw, "responses", _KNOWN, RESPONSES_REFUSED)
    _check_unsupported(body)
    tenant = tenant_of(caller, req.headers.get("x-tenant"), body.user)
    lora = check_adapter_model(body.model, config, tenant, state.engine.lora_names)
    store = state.responses
    keep = store is not None and body.store is not False
    context = [*await previous_context(store, body.previous_response_id, tenant),
               *input_items(body)]  # fmt: skip
    if not context:
        raise bad_request("input must not be empty", param="input")
    chat = chat_request(body, context)
    max_tokens = check_max_tokens(body.max_output_tokens, "max_output_tokens", config)
    sampling = sampling_fields(chat, None, config)
    pre = Prelude(state, ROUTE, req, out, chat, arrival, received, 1, max_tokens,
                  "max_output_tokens", None, sampling, tenant, response_id(), lora=lora)  # fmt: skip
    prompter = state.prompter
    tools = await plan_tools(chat, prompter.grammars, tenant)
    grammar = await _format_grammar(prompter.grammars, chat.response_format, tenant)
    if grammar is not None and tools.grammar is not None:
        raise bad_request(
            "text.format cannot be combined with a required or named tool_choice",
            param="text.format",
        )
    grammar = grammar or tools.grammar
    if grammar is not None:
        pre.sampling["grammar"] = grammar
    parser = make_parser(config.tool_call_parser) if tools.read_calls else None
    answer = Answer(pre, body, keep)

    async def save(response: dict[str, Any]) -> None:
        if keep:
            assert store is not None
            await store.put(tenant, response, context)

    async def build(choices: list[ChoiceResult], usage: Usage) -> dict[str, Any]:
        choice = choices[0]
        items = output_items(choice.text, choice.finish_reason, parser)
        response = answer.done(items, choice.finish_reason, usage)
        await save(response)
        return response

    events = ResponseEvents(parser)

    async def write(stream: RequestStream, out: Responder) -> None:
        await _stream(stream, out, answer, events, save, config)

    with pre.admit() as ticket:
        prompt_ids = await _prompt(pre, chat, tools, body.truncation == "auto")
        params = pre.params(prompt_ids, "input")
        pre.admit_tokens(ticket, [prompt_ids])
        job = pre.job(ticket, [prompt_ids], [params])
        await pre.respond(job, _NO_CHUNKS, build, write, partial(_failure, events, answer))


async def _format_grammar(
    grammars: Grammars, fmt: ResponseFormat | None, tenant: str
) -> str | None:
    """text.format's grammar, its errors naming text.format (chat's name response_format)."""
    if isinstance(fmt, JsonObjectFormat):
        return await grammars.json_schema(
            {"type": "object"}, strict=True, param="text.format", tenant=tenant
        )
    if isinstance(fmt, JsonSchemaFormat):
        spec = fmt.json_schema
        schema = {"type": "object"} if spec.schema_ is None else spec.schema_
        return await grammars.json_schema(
            schema, strict=bool(spec.strict), param="text.format.schema", tenant=tenant
        )
    return None


async def _prompt(
    pre: Prelude[Any], chat: ChatCompletionRequest, tools: Any, auto: bool
) -> list[int]:
    """The prompt's ids; with truncation auto, the oldest messages after the system ones are
    dropped while the prompt and the output budget pass the context."""
    prompter, config = pre.state.prompter, pre.state.config
    parallel = chat.parallel_tool_calls is not False
    messages = list(chat.messages)
    limit = config.model.max_model_len - (pre.max_tokens or 1)
    for _ in range(MAX_TRUNCATIONS):
        rendered = template_messages(messages, tools, prompter.chat_template.takes_tools, parallel)
        ids = await prompter.chat_ids(
            rendered, tools=tools.offered if prompter.chat_template.takes_tools else None
        )
        first = next((i for i, m in enumerate(messages) if m.role != "system"), len(messages))
        if not auto or len(ids) <= limit or first >= len(messages) - 1:
            return ids
        del messages[first]
    return ids


class _NoChunks:
    """The chunk format `respond` is given; the Responses writer makes its own events."""

    def opening(self, index: int, first: Any) -> None:
        return None

    def delta(self, index: int, delta: Any) -> None:
        return None

    def plain(self, index: int, delta: Any) -> None:
        return None  # why: each event is numbered, so the listener never writes one itself

    def usage(self, usage: Usage) -> bytes:
        return b""


_NO_CHUNKS = _NoChunks()


def _failure(events: ResponseEvents, answer: Answer, exc: ApiError) -> bytes:
    """A started stream's last events when it fails: `error`, then `response.failed` (no
    [DONE]: the Responses API numbers its events and never sends one)."""
    opening = b"" if events.sequence else events.opening(answer.head)
    error = events.event("error", code=exc.code, message=exc.message, param=exc.param)
    return opening + error + events.event("response.failed", response=answer.failed(exc))


async def _stream(
    stream: RequestStream,
    out: Responder,
    answer: Answer,
    events: ResponseEvents,
    save: Any,
    config: EngineConfig,
) -> None:
    """The typed events as deltas arrive (responses_events.py): `response.created` and
    `response.in_progress` at once, as the request is admitted, then the output's; the
    response is stored before its last event. A failure after that is its events."""
    stream.write_to(_NO_CHUNKS, out, config.sse_keepalive_s)
    reason: str | None = None
    try:
        await out.frames(events.opening(answer.head))
        async with aclosing(stream.deltas()) as deltas:
            async for _, delta, received in deltas:
                if delta is None:  # IDLE: nothing came for keepalive_s
                    await out.comment()
                    continue
                await out.frames(events.delta(delta))
                metrics.observer.streamed(time.perf_counter() - received)
                reason = delta.finish_reason
    except (ApiError, StreamCut) as exc:
        cut = isinstance(exc, StreamCut)
        if cut:
            stream.job.stats.finish_reason = "abort"
            exc = cut_error(exc)
        if not out.started:
            raise exc from None
        frames = _failure(events, answer, exc)
        # a cut (the server is going away) is written past flow control, as chat's is
        if cut and out.cut_now(frames):
            return
        await out.frames(frames)
        await out.end_stream()
        return
    response = answer.done(events.output, reason, stream.usage())
    await save(response)
    kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    await out.frames(events.event(kind, response=response))
    await out.end_stream()


async def handle_stored(
    state: FrontendState, req: HttpRequest, out: Responder, caller: Caller
) -> None:
    """GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items."""
    rest = req.path[len("/v1/responses/") :]
    rid, _, sub = rest.partition("/")
    if sub not in ("", "input_items") or (sub and req.method != "GET"):
        raise ApiError(404, f"no route for {req.path}", code="not_found")
    tenant = tenant_of(caller, req.headers.get("x-tenant"), None)
    store = state.responses
    if store is None:
        raise not_found(rid)
    if req.method == "DELETE":
        if not await store.delete(rid, tenant):
            raise not_found(rid)
        await out.json(200, {"id": rid, "object": "response.deleted", "deleted": True})
        return
    stored = await store.get(rid, tenant)
    if stored is None:
        raise not_found(rid)
    if not sub:
        await out.json(200, stored.response)
        return
    await out.json(200, _page(stored.context, req))


def _page(items: list[Item], req: HttpRequest) -> dict[str, Any]:
    """A list page of input items: `order` (desc, the default, or asc), `after` an item id,
    `limit` 1 to 100 (default 20)."""
    from urllib.parse import parse_qs

    query = parse_qs(req.scope.get("query_string", b"").decode("latin-1"))
    order = query.get("order", ["desc"])[-1]
    if order not in ("asc", "desc"):
        raise bad_request("order must be asc or desc", param="order")
    raw_limit = query.get("limit", ["20"])[-1]
    if not (raw_limit.isascii() and raw_limit.isdigit() and 1 <= int(raw_limit) <= 100):
        raise bad_request("limit must be an integer from 1 to 100", param="limit")
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after", [None])[-1]
    if after is not None:
        ids = [it["id"] for it in ordered]
        if after not in ids:
            raise bad_request(f"after: no input item {after!r} in this response", param="after")
        ordered = ordered[ids.index(after) + 1 :]
    page = ordered[: int(raw_limit)]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(ordered) > len(page),
    }
