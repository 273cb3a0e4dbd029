"""A Responses request's input, tools and text format in the chat route's terms.

Input items are normalized into the item dicts the API returns (each with an id, text parts
typed `input_text` or `output_text`); those dicts are what a stored response keeps as its
context, and `chat_messages` turns any list of them into the chat template's messages: a
`function_call` becomes a tool call of an assistant message (consecutive calls share one), a
`function_call_output` a `tool` message answering its call.
"""

from __future__ import annotations

import secrets
from typing import Any

from gapless.frontend.api.protocol import (
    CalledFunction,
    ChatMessage,
    FunctionDef,
    JsonObjectFormat,
    JsonSchemaFormat,
    JsonSchemaSpec,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolCall,
    ToolChoice,
)
from gapless.frontend.api.responses_protocol import (
    ContentPart,
    FunctionTool,
    InputItem,
    ResponsesRequest,
    TextConfig,
)
from gapless.frontend.http.errors import bad_request

Item = dict[str, Any]
ROLES = ("system", "developer", "user", "assistant")
TEXT_PARTS = ("input_text", "output_text")


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def _text(parts: str | list[ContentPart] | None, at: str, kind: str) -> list[dict[str, str]]:
    """Text parts as the API returns them: a string is one part of `kind`."""
    if parts is None:
        return []
    if isinstance(parts, str):
        return [{"type": kind, "text": parts}]
    out = []
    for j, part in enumerate(parts):
        if part.type not in TEXT_PARTS or part.text is None:
            raise bad_request(
                f"{at}[{j}]: content of type {part.type!r} is not supported; only text "
                "(input_text, output_text) is",
                param=f"{at}[{j}].type",
            )
        out.append({"type": part.type, "text": part.text})
    return out


def _required(value: str | None, at: str, field: str) -> str:
    if value is None:
        raise bad_request(f"{at} needs `{field}`", param=f"{at}.{field}")
    return value


def input_items(request: ResponsesRequest) -> list[Item]:
    """The request's input as normalized items (a string is one user message)."""
    if isinstance(request.input, str):
        return [_message("user", [{"type": "input_text", "text": request.input}])]
    return [_item(it, f"input[{i}]") for i, it in enumerate(request.input)]


def _message(role: str, content: list[dict[str, str]], id: str | None = None) -> Item:
    return {
        "type": "message",
        "id": id or item_id("msg"),
        "role": role,
        "content": content,
        "status": "completed",
    }


def _item(it: InputItem, at: str) -> Item:
    if it.type == "message":
        if it.role not in ROLES:
            raise bad_request(
                f"{at}.role must be one of {', '.join(ROLES)}, got {it.role!r}", param=f"{at}.role"
            )
        kind = "output_text" if it.role == "assistant" else "input_text"
        return _message(it.role, _text(it.content, f"{at}.content", kind), it.id)
    if it.type == "function_call":
        return {
            "type": "function_call",
            "id": it.id or item_id("fc"),
            "call_id": _required(it.call_id, at, "call_id"),
            "name": _required(it.name, at, "name"),
            "arguments": _required(it.arguments, at, "arguments"),
            "status": "completed",
        }
    if it.type == "function_call_output":
        output = it.output
        if output is None:
            raise bad_request(f"{at} needs `output`", param=f"{at}.output")
        if not isinstance(output, str):
            output = "".join(p["text"] for p in _text(output, f"{at}.output", "input_text"))
        return {
            "type": "function_call_output",
            "id": it.id or item_id("fco"),
            "call_id": _required(it.call_id, at, "call_id"),
            "output": output,
            "status": "completed",
        }
    raise bad_request(
        f"{at}: items of type {it.type!r} are not supported; messages, function_call and "
        "function_call_output are",
        param=f"{at}.type",
    )


def chat_messages(items: list[Item], instructions: str | None) -> list[ChatMessage]:
    """The conversation as the chat route's messages, the instructions first."""
    out = [] if instructions is None else [ChatMessage(role="system", content=instructions)]
    for item in items:
        kind = item["type"]
        if kind == "message":
            text = "".join(p["text"] for p in item["content"])
            out.append(ChatMessage(role=item["role"], content=text))
        elif kind == "function_call":
            call = ToolCall(
                id=item["call_id"],
                function=CalledFunction(name=item["name"], arguments=item["arguments"]),
            )
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and last.tool_calls is not None:
                last.tool_calls.append(call)
            elif last is not None and last.role == "assistant":
                last.tool_calls = [call]
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        else:
            out.append(
                ChatMessage(role="tool", content=item["output"], tool_call_id=item["call_id"])
            )
    return out


def chat_tools(tools: list[FunctionTool] | None) -> list[Tool] | None:
    """Flat function tools as the chat route's; a built-in tool is a 400 naming it. A
    function without `strict` is strict, as in OpenAI's Responses API."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise bad_request(
                f"tools[{i}]: the built-in tool {tool.type!r} is not supported; only function "
                "tools are",
                param=f"tools[{i}].type",
                code="unsupported_tool",
            )
        name = _required(tool.name, f"tools[{i}]", "name")
        strict = True if tool.strict is None else tool.strict
        out.append(
            Tool(
                type="function",
                function=FunctionDef(
                    name=name,
                    description=tool.description,
                    parameters=tool.parameters,
                    strict=strict,
                ),
            )
        )
    return out


def chat_tool_choice(request: ResponsesRequest) -> ToolChoice | None:
    choice = request.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type != "function":
        raise bad_request(
            f"tool_choice of type {choice.type!r} is not supported; none, auto, required or "
            '{"type": "function", "name": ...} is',
            param="tool_choice",
        )
    name = _required(choice.name, "tool_choice", "name")
    return NamedToolChoice(type="function", function=NamedFunction(name=name))


def response_format(text: TextConfig | None) -> ResponseFormat | None:
    if text is None:
        return None
    if text.verbosity is not None:
        raise bad_request(
            "text.verbosity: the served model takes no verbosity",
            param="text.verbosity",
            code="unsupported_field",
        )
    fmt = text.format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return JsonObjectFormat()
    if fmt.name is None:
        raise bad_request("text.format needs `name` for json_schema", param="text.format.name")
    spec = JsonSchemaSpec(
        name=fmt.name, description=fmt.description, schema_=fmt.schema_, strict=fmt.strict
    )
    return JsonSchemaFormat(json_schema=spec)


def text_config(text: TextConfig | None) -> dict[str, Any]:
    """The response's `text` field: the format as asked (text when none)."""
    fmt = text.format if text is not None else None
    if fmt is None:
        return {"format": {"type": "text"}}
    out: dict[str, Any] = {"type": fmt.type}
    if fmt.type == "json_schema":
        out.update(name=fmt.name, schema=fmt.schema_, strict=bool(fmt.strict))
        if fmt.description is not None:
            out["description"] = fmt.description
    return {"format": out}
