"""GET /openapi.json: an OpenAPI 3.1 document built from the msgspec schemas themselves."""

from __future__ import annotations

from typing import Any

import msgspec

from gapless.core.common.config import (
    MAX_PRIORITY,
    MAX_TENANT_CHARS,
    MIN_PRIORITY,
    PRIORITY_NAMES,
    EngineConfig,
)
from gapless.frontend.errors import ErrorResponse
from gapless.frontend.protocol import ChatCompletionRequest, CompletionRequest
from gapless.frontend.responses import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    Health,
    ModelCard,
    ModelList,
)
from gapless.frontend.utility_routes import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    Version,
)

_REF = "#/components/schemas/{name}"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(name=name)}


def _errors(*statuses: int) -> dict[str, Any]:
    body = {"content": {"application/json": {"schema": _ref("ErrorResponse")}}}
    return {str(s): {"description": "error", **body} for s in statuses}


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
                    "`data: <chunk>` events ending with `data: [DONE]`",
                    "content": {
                        "application/json": {"schema": _ref(whole)},
                        "text/event-stream": {"schema": _ref(chunk)},
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


_INT64 = 2**63


def _ranges(config: EngineConfig) -> dict[str, dict[str, Any]]:
    """field -> constraints per JSON type, as frontend.params checks them (the limits of the
    running config included), so a schema fuzzer generates what the server accepts."""
    vocab_id = {"minimum": 0, "maximum": config.model.vocab_size - 1}
    logprobs = {"integer": {"minimum": 0, "maximum": config.max_logprobs}}
    budget = {"integer": {"minimum": 1, "maximum": config.model.max_model_len}}
    return {
        "max_tokens": budget,
        "max_completion_tokens": budget,
        "temperature": {"number": {"minimum": 0, "maximum": 2}},
        "top_p": {"number": {"exclusiveMinimum": 0, "maximum": 1}},
        "min_p": {"number": {"minimum": 0, "maximum": 1}},
        "top_k": {"integer": {"minimum": -1}},
        "n": {"integer": {"minimum": 1, "maximum": config.max_n}},
        "presence_penalty": {"number": {"minimum": -2, "maximum": 2}},
        "frequency_penalty": {"number": {"minimum": -2, "maximum": 2}},
        "repetition_penalty": {"number": {"exclusiveMinimum": 0, "maximum": 10}},
        "seed": {"integer": {"minimum": -_INT64, "maximum": _INT64 - 1}},
        "logprobs": logprobs,
        "top_logprobs": logprobs,
        "stop": {
            "string": {"minLength": 1},
            "array": {"maxItems": config.max_stop_strings, "items": {"minLength": 1}},
        },
        "stop_token_ids": {"array": {"items": vocab_id}},
        "priority": {
            "integer": {"minimum": MIN_PRIORITY, "maximum": MAX_PRIORITY},
            "string": {"enum": sorted(PRIORITY_NAMES)},
        },
        "user": {
            "string": {"maxLength": MAX_TENANT_CHARS, "pattern": "^[^\\x00-\\x1f\\x7f-\\x9f]*$"}
        },
        "prompt": {"string": {"minLength": 1}, "array": {"minItems": 1}},
        "messages": {"array": {"minItems": 1}},
    }


def _constrain(schema: dict[str, Any], by_type: dict[str, dict[str, Any]]) -> None:
    for option in schema.get("anyOf", [schema]):
        extra = by_type.get(option.get("type", ""))
        if extra is None:
            continue
        for key, value in extra.items():
            if key == "items" and "items" in option:
                option["items"].update(value)
            else:
                option[key] = value


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
    ]
    _, components = msgspec.json.schema_components(types, ref_template=_REF)
    if config is not None:
        ranges = _ranges(config)
        for name in ("CompletionRequest", "ChatCompletionRequest"):
            for field, schema in components[name]["properties"].items():
                if field in ranges:
                    _constrain(schema, ranges[field])
    health = _get("Health", "200 while the engine is alive, else 503", 503)
    metrics = _plain("Prometheus text format", "text/plain", 401)
    doc = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": {
            "/v1/completions": _generate(
                "CompletionRequest", "Completion", "Completion", "text completion"
            ),
            "/v1/chat/completions": _generate(
                "ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk", "chat completion"
            ),
            "/v1/models": _get("ModelList", "the served model", 401),
            "/v1/models/{model}": _get("ModelCard", "one model, if it is the served one", 401, 404),
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
            "/v1/engine/stats": _plain(
                "the core's queues and KV blocks", "application/json", 401, 503
            ),
            "/v1/engine/timeline": _plain(
                "the device timeline of the last `last` steps (query, default 256)",
                "application/json",
                400,
                401,
                503,
            ),
            "/metrics": metrics,
            "/health": health,
            "/openapi.json": {
                "get": {"summary": "this document", "responses": {"200": {"description": "ok"}}}
            },
        },
        "components": {"schemas": components},
    }
    if config is None or config.api_key or config.api_keys:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
        health["get"]["security"] = []  # why: probes carry no key
        if config is None or not config.metrics_require_key:
            metrics["get"]["security"] = []
    return doc
