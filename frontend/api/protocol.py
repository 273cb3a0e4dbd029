"""Request bodies of the OpenAI-compatible API, as msgspec schemas (decoding is validation).

Optional fields accept JSON null, as the OpenAI API does. Values are range-checked in
`frontend.api.params`, where the limits of the running config are known.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

Role = Literal["system", "developer", "user", "assistant", "tool"]  # developer: as system


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class PredictionPart(msgspec.Struct):
    type: Literal["text"]
    text: str


class Prediction(msgspec.Struct):
    """OpenAI's Predicted Outputs: text much of the answer is expected to repeat."""

    type: Literal["content"]
    content: str | list[PredictionPart]


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields both generation endpoints share (OpenAI names, then engine extras)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    # engine extras
    top_k: int | None = None  # 0 or -1 disables
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_tokens: int | None = None  # EOS and stop token ids cannot end the output before this
    allowed_token_ids: list[int] | None = None  # sample only among these
    bad_words: list[str] | None = None  # never completed, as text with or without a space before
    # an integer in [-1000, 1000], lower runs sooner, or interactive (-10), default (0), batch (10);
    # absent: the tenant's default. Checked in frontend.engine.tenants
    priority: int | str | None = None
    # prefix-cache blocks are shared only between requests with the same salt (and none)
    cache_salt: str | None = None
    # drafts to verify (speculative decoding): the output is unchanged, only faster where it
    # repeats them; on completions an extension
    prediction: Prediction | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/completions. A prompt (text or token ids) or a batch of them (a list of
    strings or of token-id lists); max_tokens defaults to 16 here, as OpenAI's does."""

    prompt: str | list[int | str | list[int]]
    logprobs: int | None = None  # 0..max_logprobs: sampled token plus this many alternatives
    echo: bool = False


class TextPart(msgspec.Struct, kw_only=True):
    type: Literal["text"] = "text"  # may be left out: text is the only kind taken
    text: str


class CalledFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text, as the API carries it


class ToolCall(msgspec.Struct, kw_only=True):
    """A call an assistant message made, sent back in the history."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # role tool: the call this answers
    tool_calls: list[ToolCall] | None = None  # role assistant


class FunctionDef(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class TextFormat(msgspec.Struct, tag="text", tag_field="type"):
    pass


class JsonObjectFormat(msgspec.Struct, tag="json_object", tag_field="type"):
    pass


class JsonSchemaSpec(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    # true: any JSON value; false: nothing matches (a 400)
    schema_: dict[str, Any] | bool | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None  # true: a keyword the grammar engine lacks is a 400


class JsonSchemaFormat(msgspec.Struct, tag="json_schema", tag_field="type"):
    json_schema: JsonSchemaSpec


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name of max_tokens; wins when both
    logprobs: bool | None = None
    top_logprobs: int | None = None  # needs logprobs=true
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # default: auto with tools, none without
    parallel_tool_calls: bool | None = None  # default true: several calls in one answer
    # engine extras, as Hugging Face's apply_chat_template takes them
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
