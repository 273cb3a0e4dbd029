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
    ModelList,
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
    ]
    _, components = msgspec.json.schema_components(types, ref_template=_REF)
    health = _get("Health", "200 while the engine is alive, else 503", 503)
    health["get"]["security"] = []  # why: probes carry no key
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
