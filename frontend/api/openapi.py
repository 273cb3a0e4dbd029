"""GET /openapi.json: an OpenAPI 3.1 document built from the msgspec schemas themselves.

With the running config it states what the server checks: value ranges, the shapes a prompt
may take, which fields need another (`top_logprobs` needs `logprobs`), and `/tokenize`'s one of
`prompt` or `messages`. A few rules depend on more than a body's shape and are stated in prose
only (tests/frontend/schema_hooks.py lists them): a prompt and max_tokens within the context
length (the prompt's tokens are known only once tokenized), min_tokens at most the output
budget, distinct tool names, a named tool_choice among the tools, a response_format or tool
schema the grammar engine compiles, and continue_final_message's last message.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gapless.common.config import (
    MAX_PRIORITY,
    MAX_TENANT_CHARS,
    MIN_PRIORITY,
    PRIORITY_NAMES,
    EngineConfig,
)
from gapless.common.messages import KEEP_STEPS
from gapless.common.sampling_ranges import (
    FLOAT_RANGES,
    LOGIT_BIAS,
    MIN_TOKENS,
    SEED,
    TOP_K,
    logprobs_range,
    max_tokens_range,
    n_range,
)
from gapless.frontend.api import responses_openapi
from gapless.frontend.api.embeddings import EMBEDDINGS_PATH, embedding_rules, embedding_types
from gapless.frontend.api.lora_routes import LoadLoraBody, UnloadLoraBody
from gapless.frontend.api.params import MAX_CACHE_SALT_CHARS, MAX_LOGIT_BIAS
from gapless.frontend.api.protocol import ChatCompletionRequest, CompletionRequest
from gapless.frontend.api.replies import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    Health,
    ModelCard,
    ModelList,
)
from gapless.frontend.api.responses_protocol import ResponsesRequest
from gapless.frontend.api.utility_routes import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    Version,
)
from gapless.frontend.http.errors import ErrorResponse

_REF = "#/components/schemas/{name}"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(name=name)}


def _errors(*statuses: int) -> dict[str, Any]:
    body = {"content": {"application/json": {"schema": _ref("ErrorResponse")}}}
    return {str(s): {"description": "error", **body} for s in statuses}


def _stream_event(chunk: str) -> dict[str, Any]:
    """One server-sent event of a stream: `data:` holds a chunk, an error object (a failure
    after the stream began), or `[DONE]` last."""
    data = {
        "type": "string",
        "if": {"const": "[DONE]"},
        "else": {
            "contentMediaType": "application/json",
            "contentSchema": {"anyOf": [_ref(chunk), _ref("ErrorResponse")]},
        },
    }
    return {"type": "object", "required": ["data"], "properties": {"data": data}}


def _generate(request: str, whole: str, chunk: str, summary: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref(request)}},
            },
            "responses": {
                "200": {
                    "description": "the whole answer, or with stream=true an SSE stream of "
                    f"`data: <{chunk}>` events ending with `data: [DONE]`",
                    "content": {
                        "application/json": {"schema": _ref(whole)},
                        "text/event-stream": {"schema": _stream_event(chunk)},
                    },
                },
                **_errors(400, 401, 404, 413, 429, 500, 503),
            },
        }
    }


def _post(request: str, response: str, summary: str, *errors: int) -> dict[str, Any]:
    ok = {"description": "ok", "content": {"application/json": {"schema": _ref(response)}}}
    body = {"required": True, "content": {"application/json": {"schema": _ref(request)}}}
    return {
        "post": {
            "summary": summary,
            "requestBody": body,
            "responses": {"200": ok, **_errors(*errors)},
        }
    }


def _plain(summary: str, content_type: str, *errors: int) -> dict[str, Any]:
    ok = {"description": "ok", "content": {content_type: {"schema": {"type": "object"}}}}
    return {"get": {"summary": summary, "responses": {"200": ok, **_errors(*errors)}}}


def _get(schema: str, summary: str, *errors: int) -> dict[str, Any]:
    ok = {"description": "ok", "content": {"application/json": {"schema": _ref(schema)}}}
    return {"get": {"summary": summary, "responses": {"200": ok, **_errors(*errors)}}}


def _parameter(name: str, where: str, schema: dict[str, Any], description: str) -> dict:
    return {
        "name": name,
        "in": where,
        "required": where == "path",
        "description": description,
        "schema": schema,
    }


# what Python's str.strip() removes (str.isspace), spelled out: a regex's \s is another set
_SPACE = "\\t-\\r \\x1c-\\x1f\\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000"


def below(n: int) -> str:
    """A regex for the decimal numbers 0 .. n - 1 without leading zeros (n >= 1)."""
    top = str(n - 1)
    options = [f"[0-9]{{1,{len(top) - 1}}}"] if len(top) > 1 else []
    for i, digit in enumerate(top):  # numbers of len(top) digits: share a prefix, then lower
        low = "1" if i == 0 and len(top) > 1 else "0"
        if int(digit) > int(low):
            options.append(f"{top[:i]}[{low}-{int(digit) - 1}][0-9]{{{len(top) - i - 1}}}")
    options.append(top)
    return "|".join(options)


def _token_ids(config: EngineConfig, **extra: Any) -> dict[str, Any]:
    vocab_id = {"type": "integer", "minimum": 0, "maximum": config.model.vocab_size - 1}
    return {"type": "array", "items": vocab_id, **extra}


def _prompt(config: EngineConfig) -> dict[str, Any]:
    """A text, token ids, or a batch of either (frontend.api.prompts): none empty, ids of the
    vocabulary, fewer ids than the context holds, at most --max-prompts in a batch."""
    text = {"type": "string", "minLength": 1}
    ids = _token_ids(config, minItems=1, maxItems=config.model.max_model_len - 1)
    batch = {"type": "array", "minItems": 1, "maxItems": config.max_prompts}
    return {"anyOf": [text, ids, {**batch, "items": {"anyOf": [text, ids]}}]}


def _ranges(config: EngineConfig) -> dict[str, dict[str, Any]]:
    """field -> constraints per JSON type, as frontend.api.params checks them (the limits of the
    running config included), so a schema fuzzer generates what the server accepts."""
    vocab_id = {"minimum": 0, "maximum": config.model.vocab_size - 1}
    logprobs = {"integer": logprobs_range(config).json_schema()}
    # why one short of the context: every prompt has a token, and both must fit in it
    budget_range = max_tokens_range(config)
    assert budget_range.high is not None
    budget = {"integer": {**budget_range.json_schema(), "maximum": budget_range.high - 1}}
    return {
        "max_tokens": budget,
        "max_completion_tokens": budget,
        **{name: {"number": allowed.json_schema()} for name, allowed in FLOAT_RANGES.items()},
        "top_k": {"integer": TOP_K.json_schema()},
        "n": {"integer": n_range(config).json_schema()},
        "seed": {"integer": SEED.json_schema()},
        "logprobs": logprobs,
        "top_logprobs": logprobs,
        "min_tokens": {"integer": MIN_TOKENS.json_schema()},
        "stop": {
            "string": {"minLength": 1},
            "array": {"maxItems": config.max_stop_strings, "items": {"minLength": 1}},
        },
        "stop_token_ids": {"array": {"items": vocab_id}},
        "allowed_token_ids": {"array": {"minItems": 1, "items": vocab_id}},
        "logit_bias": {
            "object": {
                "maxProperties": MAX_LOGIT_BIAS,
                "propertyNames": {"pattern": f"^0*(?:{below(config.model.vocab_size)})$"},
                "additionalProperties": LOGIT_BIAS.json_schema(),
            }
        },
        "bad_words": {"array": {"items": {"pattern": f"[^{_SPACE}]"}}},
        "cache_salt": {"string": {"minLength": 1, "maxLength": MAX_CACHE_SALT_CHARS}},
        "priority": {
            "integer": {"minimum": MIN_PRIORITY, "maximum": MAX_PRIORITY},
            "string": {"enum": sorted(PRIORITY_NAMES)},
        },
        "user": {
            "string": {"maxLength": MAX_TENANT_CHARS, "pattern": "^[^\\x00-\\x1f\\x7f-\\x9f]*$"}
        },
        "messages": {"array": {"minItems": 1}},
    }


def _constrain(schema: dict[str, Any], by_type: dict[str, dict[str, Any]]) -> None:
    for option in schema.get("anyOf", [schema]):
        extra = by_type.get(option.get("type", ""))
        if extra is None:
            continue
        for key, value in extra.items():
            if key in ("items", "additionalProperties") and key in option:
                option[key].update(value)
            else:
                option[key] = value


def _given(field: str, schema: dict[str, Any]) -> dict[str, Any]:
    """Matches a body that has field, with a value schema matches."""
    return {"required": [field], "properties": {field: schema}}


# fields of a chat request that need another: a JSON Schema `if` / `then` each
_CHAT_NEEDS = [
    # top_logprobs needs logprobs set to true (frontend.api.chat)
    (_given("top_logprobs", {"type": "integer"}), _given("logprobs", {"const": True})),
    # a tool_choice other than none needs tools (frontend.api.tools)
    (
        _given("tool_choice", {"not": {"enum": ["none", None]}}),
        _given("tools", {"type": "array", "minItems": 1}),
    ),
    # continue_final_message cannot go with add_generation_prompt, true by default
    (
        _given("continue_final_message", {"const": True}),
        _given("add_generation_prompt", {"const": False}),
    ),
]


def _request_rules(components: dict[str, Any], config: EngineConfig) -> None:
    ranges = _ranges(config)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        for field, schema in components[name]["properties"].items():
            if field in ranges:
                _constrain(schema, ranges[field])
    components["CompletionRequest"]["properties"]["prompt"] = _prompt(config)
    chat = components["ChatCompletionRequest"]
    chat["allOf"] = [{"if": when, "then": then} for when, then in _CHAT_NEEDS]
    tokenize = components["TokenizeRequest"]
    tokenize["properties"]["prompt"]["anyOf"][0]["minLength"] = 1
    tokenize["properties"]["messages"]["anyOf"][0]["minItems"] = 1
    # one of prompt or messages, not both (frontend.api.utility_routes)
    tokenize["oneOf"] = [
        _given("prompt", {"type": "string"}),
        _given("messages", {"type": "array"}),
    ]
    components["DetokenizeRequest"]["properties"]["tokens"] = _token_ids(config)
    embedding_rules(components["EmbeddingRequest"], _token_ids(config), config)
    responses_openapi.request_rules(components["ResponsesRequest"], ranges, _constrain)
    for field in ("user", "priority"):
        _constrain(components["EmbeddingRequest"]["properties"][field], ranges[field])


def _stream_chunks(components: dict[str, Any]) -> None:
    """CompletionChunk: a streamed `text_completion` chunk, the shape of a whole Completion
    (the last one may carry only usage, with no choices)."""
    chunk = dict(components["Completion"], title="CompletionChunk")
    chunk["description"] = "One event of a streamed completion: choices' text as it comes"
    components["CompletionChunk"] = chunk


OPERATION_IDS = {
    "/v1/completions": "createCompletion",
    "/v1/chat/completions": "createChatCompletion",
    EMBEDDINGS_PATH: "createEmbedding",
    "/v1/models": "listModels",
    "/v1/models/{model}": "retrieveModel",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
    "/version": "version",
    "/v1/engine/stats": "engineStats",
    "/v1/engine/timeline": "engineTimeline",
    "/reset_prefix_cache": "resetPrefixCache",
    "/metrics": "metrics",
    "/health": "health",
    "/live": "live",
    "/openapi.json": "openapi",
    **responses_openapi.OPERATION_IDS,
}


def _operations(paths: dict[str, Any]) -> None:
    """Operation ids, and the links from one answer to the next request: the listed model's
    card, and the ids /tokenize gave back to /detokenize."""
    for path, operation_id in OPERATION_IDS.items():
        (operation,) = paths[path].values()
        operation["operationId"] = operation_id
    model = {"operationId": "retrieveModel", "parameters": {"model": "$response.body#/data/0/id"}}
    paths["/v1/models"]["get"]["responses"]["200"]["links"] = {"model": model}
    text = {"operationId": "detokenize", "requestBody": {"tokens": "$response.body#/tokens"}}
    paths["/tokenize"]["post"]["responses"]["200"]["links"] = {"text": text}


def _lora_routes(doc: dict[str, Any]) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with --lora-dir)."""
    _, schemas = msgspec.json.schema_components([LoadLoraBody, UnloadLoraBody], ref_template=_REF)
    doc["components"]["schemas"].update(schemas)
    for path, body, summary, operation_id in (
        ("/v1/load_lora_adapter", "LoadLoraBody", "load a LoRA adapter from under --lora-dir",
         "loadLoraAdapter"),
        ("/v1/unload_lora_adapter", "UnloadLoraBody", "unload a LoRA adapter",
         "unloadLoraAdapter"),
    ):  # fmt: skip
        route = _post(body, "ErrorResponse", f"{summary} (the admin key)", 400, 401, 403, 404, 503)
        route["post"]["operationId"] = operation_id
        ok = {"text/plain": {"schema": {"type": "string"}}}
        route["post"]["responses"]["200"]["content"] = ok
        doc["paths"][path] = route


def openapi_document(
    title: str, version: str, config: EngineConfig | None = None
) -> dict[str, Any]:
    """The API's description; with `config`, value ranges as that server checks them, and
    bearer auth only when it has keys."""
    types = [
        CompletionRequest,
        Completion,
        ChatCompletionRequest,
        ChatCompletion,
        ChatCompletionChunk,
        ModelList,
        Health,
        ErrorResponse,
        ModelCard,
        TokenizeRequest,
        TokenizeResponse,
        DetokenizeRequest,
        DetokenizeResponse,
        Version,
        *embedding_types(),
        ResponsesRequest,
    ]
    _, components = msgspec.json.schema_components(types, ref_template=_REF)
    components.update(responses_openapi.components())
    _stream_chunks(components)
    if config is not None:
        _request_rules(components, config)
    health = _get("Health", "200 while the engine is alive, else 503", 503)
    health["get"]["responses"]["503"] = {  # why: the same body, saying why it is not ok
        "description": "dead, unresponsive, stalled or draining",
        "content": {"application/json": {"schema": _ref("Health")}},
    }
    live = _get("Health", "200 while the server lives, loading and draining too (liveness)", 503)
    metrics = _plain("Prometheus text format", "text/plain", 401)
    model = _get("ModelCard", "one model, if it is the served one", 401, 404)
    name = _parameter("model", "path", {"type": "string"}, "the served model's name")
    model["get"]["parameters"] = [name]
    timeline = _plain(
        "the device timeline of the last `last` steps (default 256)",
        "application/json",
        400,
        401,
        403,
        503,
    )
    steps = {"type": "integer", "minimum": 0, "maximum": KEEP_STEPS}
    last = _parameter("last", "query", steps, "steps to return; absent or empty: 256")
    last["allowEmptyValue"] = True
    top = (config.data_parallel_size if config is not None else 64) - 1
    replica = _parameter(
        "replica",
        "query",
        {"type": "integer", "minimum": 0, "maximum": top},
        "which engine replica answers (--data-parallel-size); absent or empty: 0",
    )
    replica["allowEmptyValue"] = True
    timeline["get"]["parameters"] = [last, replica]
    stats = _plain(
        "a core's queues and KV blocks (the admin key)", "application/json", 400, 401, 403, 503
    )
    stats["get"]["parameters"] = [replica]
    reset = _plain(
        "every replica forgets its cached prefixes (the admin key); 409 while requests hold "
        "KV blocks",
        "application/json", 401, 403, 409, 503,
    )  # fmt: skip
    doc = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": {
            "/v1/completions": _generate(
                "CompletionRequest", "Completion", "CompletionChunk", "text completion"
            ),
            "/v1/chat/completions": _generate(
                "ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk", "chat completion"
            ),
            EMBEDDINGS_PATH: _post(
                "EmbeddingRequest", "EmbeddingList", "embeddings", 400, 401, 404, 413, 429, 500, 503
            ),
            **responses_openapi.paths(_ref, _errors),
            "/v1/models": _get("ModelList", "the served model", 401),
            "/v1/models/{model}": model,
            "/tokenize": _post(
                "TokenizeRequest",
                "TokenizeResponse",
                "a prompt or messages as token ids",
                400,
                401,
                404,
            ),
            "/detokenize": _post(
                "DetokenizeRequest", "DetokenizeResponse", "token ids as text", 400, 401, 404
            ),
            "/version": _get("Version", "the server's version", 401),
            "/v1/engine/stats": stats,
            "/v1/engine/timeline": timeline,
            "/reset_prefix_cache": {"post": reset["get"]},
            "/metrics": metrics,
            "/health": health,
            "/live": live,
            "/openapi.json": {
                "get": {"summary": "this document", "responses": {"200": {"description": "ok"}}}
            },
        },
        "components": {"schemas": components},
    }
    if config is not None and config.lora_dirs:
        _lora_routes(doc)
    _operations(doc["paths"])
    if config is None or config.api_key or config.api_keys or config.admin_api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
        health["get"]["security"] = []  # why: probes carry no key
        live["get"]["security"] = []
        if config is None or not config.metrics_require_key:
            metrics["get"]["security"] = []
    return doc
