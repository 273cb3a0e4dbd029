"""GET /openapi.json: an OpenAPI 3.1 document built from the msgspec schemas themselves."""

from __future__ import annotations

from typing import Any

import msgspec

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


def openapi_document(title: str, version: str) -> dict[str, Any]:
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
    health = _get("Health", "200 while the engine is alive, else 503", 503)
    health["get"]["security"] = []  # why: probes carry no key
    metrics = _plain("Prometheus text format", "text/plain", 401)
    metrics["get"]["security"] = []  # without --metrics-require-key
    return {
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
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }
