"""POST /v1/responses: the request body as msgspec schemas (decoding is validation).

Input items are decoded loosely (one struct with every item kind's fields, `type` defaulting to
a message, as clients that resend history leave it out) and checked item by item in
`frontend.api.responses_input`, where a wrong one gets a 400 naming its place.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class ContentPart(msgspec.Struct, kw_only=True):
    type: str  # input_text, output_text; anything else is refused
    text: str | None = None


class InputItem(msgspec.Struct, kw_only=True):
    """A message, a function_call or a function_call_output (each item kind's fields)."""

    type: str = "message"
    id: str | None = None
    status: str | None = None
    # message
    role: str | None = None
    content: str | list[ContentPart] | None = None
    # function_call
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    # function_call_output: text, or text parts
    output: str | list[ContentPart] | None = None


class FunctionTool(msgspec.Struct, kw_only=True):
    """A flat function tool; any other `type` (a built-in tool) is refused by name."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # absent: true, as the Responses API's default


class ToolChoiceFunction(msgspec.Struct, kw_only=True):
    type: str  # "function"; another kind (a built-in tool, allowed_tools) is refused
    name: str | None = None


class TextFormatSpec(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormatSpec | None = None
    verbosity: str | None = None  # refused unless null: the model takes no verbosity


class Reasoning(msgspec.Struct, kw_only=True):
    effort: str | None = None  # refused unless null: the model takes no reasoning effort
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesStreamOptions(msgspec.Struct, kw_only=True):
    include_obfuscation: bool | None = None  # no obfuscation field is sent either way


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """POST /v1/responses (OpenAI names, then engine extras as the chat route takes them)."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None  # a system message first; not carried to a continuation
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None  # kept with the response, returned as given
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None  # auto: oldest items dropped to fit
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = None  # default true (when the server keeps responses)
    previous_response_id: str | None = None
    include: list[str] | None = None
    reasoning: Reasoning | None = None
    top_logprobs: int | None = None  # refused above 0
    # engine extras
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    priority: int | str | None = None
    cache_salt: str | None = None
