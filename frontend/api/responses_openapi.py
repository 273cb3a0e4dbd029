"""The /v1/responses routes in /openapi.json: their paths and the reply schemas (replies are
built as dicts, frontend.api.responses, so their schemas are written here)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

RESPONSES_PATH = "/v1/responses"
STORED_PATH = "/v1/responses/{response_id}"
ITEMS_PATH = "/v1/responses/{response_id}/input_items"
OPERATION_IDS = {
    RESPONSES_PATH: "createResponse",
    ITEMS_PATH: "listInputItems",
}

_ITEM = {
    "type": "object",
    "required": ["type", "id"],
    "properties": {
        "type": {"enum": ["message", "function_call", "function_call_output"]},
        "id": {"type": "string"},
    },
}
_USAGE = {
    "type": "object",
    "required": ["input_tokens", "output_tokens", "total_tokens"],
    "properties": {
        name: {"type": "integer", "minimum": 0}
        for name in ("input_tokens", "output_tokens", "total_tokens")
    },
}


# accepted as on the chat route, and left out of the document (docs/responses.md lists them)
ENGINE_EXTRAS = (
    "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "stop", "logit_bias", "ignore_eos", "priority", "cache_salt",
)  # fmt: skip
_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"enum": ["input_text", "output_text"]}, "text": {"type": "string"}},
}
_TEXT = {"anyOf": [{"type": "string"}, {"type": "array", "items": _PART}]}
_INPUT_ITEM = {
    "anyOf": [
        {
            "type": "object",
            "required": ["role"],
            "properties": {
                "type": {"const": "message"},
                "role": {"enum": ["system", "developer", "user", "assistant"]},
                "content": {"anyOf": [*_TEXT["anyOf"], {"type": "null"}]},
            },
        },
        {
            "type": "object",
            "required": ["type", "call_id", "name", "arguments"],
            "properties": {
                "type": {"const": "function_call"},
                **{k: {"type": "string"} for k in ("call_id", "name", "arguments")},
            },
        },
        {
            "type": "object",
            "required": ["type", "call_id", "output"],
            "properties": {
                "type": {"const": "function_call_output"},
                "call_id": {"type": "string"},
                "output": _TEXT,
            },
        },
    ]
}


def request_rules(
    request: dict[str, Any],
    ranges: dict[str, dict[str, Any]],
    constrain: Callable[[dict[str, Any], dict[str, dict[str, Any]]], None],
) -> None:
    """The rules of frontend.api.responses_input that a schema can state, and the chat route's
    ranges under the Responses names."""
    props = request["properties"]
    for name in ENGINE_EXTRAS:
        del props[name]
    named = {"max_output_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p"}
    for field, rule in {**named, "user": "user"}.items():
        constrain(props[field], ranges[rule])
    constrain(props["top_logprobs"], {"integer": {"minimum": 0, "maximum": 0}})
    props["input"] = {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": _INPUT_ITEM}]}  # fmt: skip
    function = {"type": "object", "required": ["type", "name"],
                "properties": {"type": {"const": "function"}, "name": {"type": "string"}}}  # fmt: skip
    props["tools"]["anyOf"][0]["items"] = {
        **function,
        "properties": {
            **function["properties"],
            "description": {"type": ["string", "null"]},
            "parameters": {"type": ["object", "null"]},
            "strict": {"type": ["boolean", "null"]},
        },
    }
    props["tool_choice"] = {"anyOf": [{"enum": ["none", "auto", "required", None]}, function]}
    props["include"]["anyOf"][0]["items"] = {
        "type": "string",
        "not": {"const": "message.output_text.logprobs"},
    }
    props["reasoning"] = {
        "anyOf": [
            {"type": "null"},
            {"type": "object", "properties": {"effort": {"enum": [None, "none"]}}},
        ]
    }
    props["text"] = {
        "anyOf": [
            {"type": "null"},
            {
                "type": "object",
                "properties": {
                    "verbosity": {"type": "null"},
                    "format": {
                        "anyOf": [
                            {"type": "null"},
                            {
                                "type": "object",
                                "required": ["type"],
                                "properties": {"type": {"enum": ["text", "json_object"]}},
                            },
                            {
                                "type": "object",
                                "required": ["type", "name"],
                                "properties": {
                                    "type": {"const": "json_schema"},
                                    "name": {"type": "string"},
                                    "schema": {"type": ["object", "null"]},
                                    "strict": {"type": ["boolean", "null"]},
                                },
                            },
                        ]  # fmt: skip
                    },
                },
            },
        ]
    }
    # a tool_choice other than none needs tools (frontend.api.tools)
    request["allOf"] = [
        {
            "if": {"required": ["tool_choice"],
                   "properties": {"tool_choice": {"not": {"enum": ["none", None]}}}},
            "then": {"required": ["tools"],
                     "properties": {"tools": {"type": "array", "minItems": 1}}},
        }
    ]  # fmt: skip


def components() -> dict[str, Any]:
    response = {
        "type": "object",
        "description": "A response (docs/responses.md)",
        "required": ["id", "object", "created_at", "status", "model", "output"],
        "properties": {
            "id": {"type": "string", "pattern": "^resp_"},
            "object": {"const": "response"},
            "created_at": {"type": "integer"},
            "status": {"enum": ["in_progress", "completed", "incomplete", "failed"]},
            "model": {"type": "string"},
            "output": {"type": "array", "items": _ITEM},
            "usage": {"anyOf": [_USAGE, {"type": "null"}]},
            "previous_response_id": {"type": ["string", "null"]},
        },
    }
    event = {
        "type": "object",
        "description": "One typed event of a streamed response",
        "required": ["type", "sequence_number"],
        "properties": {
            "type": {"type": "string"},
            "sequence_number": {"type": "integer", "minimum": 0},
        },
    }
    items = {
        "type": "object",
        "required": ["object", "data", "has_more"],
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": _ITEM},
            "has_more": {"type": "boolean"},
        },
    }
    deleted = {
        "type": "object",
        "required": ["id", "object", "deleted"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "response.deleted"},
            "deleted": {"const": True},
        },
    }
    return {
        "Response": response,
        "ResponseStreamEvent": event,
        "ResponseItemList": items,
        "ResponseDeleted": deleted,
    }


def paths(
    ref: Callable[[str], dict[str, str]], errors: Callable[..., dict[str, Any]]
) -> dict[str, Any]:
    """POST /v1/responses, GET and DELETE /v1/responses/{id}, GET .../input_items."""
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": {"type": "string"},
            "data": {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": ref("ResponseStreamEvent"),
            },
        },
    }
    create = {
        "summary": "a response (the Responses API)",
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": ref("ResponsesRequest")}},
        },
        "responses": {
            "200": {
                "description": "the response, or with stream=true its typed SSE events, the "
                "last response.completed, response.incomplete or response.failed (no [DONE])",
                "content": {
                    "application/json": {"schema": ref("Response")},
                    "text/event-stream": {"schema": event},
                },
            },
            **errors(400, 401, 404, 413, 429, 500, 503),
        },
    }
    rid = {
        "name": "response_id",
        "in": "path",
        "required": True,
        "description": "a stored response's id (another tenant's reads as missing)",
        "schema": {"type": "string"},
    }

    def ok(schema: str, summary: str) -> dict[str, Any]:
        body = {"content": {"application/json": {"schema": ref(schema)}}}
        return {
            "summary": summary,
            "parameters": [rid],
            "responses": {"200": {"description": "ok", **body}, **errors(400, 401, 404)},
        }

    items = ok("ResponseItemList", "the input items a stored response stood on")
    items["parameters"] = [
        rid,
        _query("limit", {"type": "integer", "minimum": 1, "maximum": 100}, "default 20"),
        _query("order", {"enum": ["asc", "desc"]}, "default desc"),
        _query("after", {"type": "string"}, "an item id: the page starts after it"),
    ]
    return {
        RESPONSES_PATH: {"post": create},
        STORED_PATH: {
            "get": {**ok("Response", "a stored response"), "operationId": "getResponse"},
            "delete": {
                **ok("ResponseDeleted", "deletes a stored response"),
                "operationId": "deleteResponse",
            },
        },
        ITEMS_PATH: {"get": items},
    }


def _query(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "query",
        "required": False,
        "description": description,
        "schema": schema,
    }
