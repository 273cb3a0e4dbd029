"""Response bodies and stream chunks of the OpenAI-compatible API, as msgspec schemas."""

from __future__ import annotations

import msgspec

from gapless.common.messages import TokenLogprob


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class CompletionTokensDetails(msgspec.Struct):
    """What the completion tokens were; gapless has no reasoning or predicted outputs."""

    reasoning_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


# ---------------------------------------------------------------- /v1/completions


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]  # characters into this choice's generated text


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int  # unix seconds
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ---------------------------------------------------------------- /v1/chat/completions


class TopLogprobOut(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]  # utf-8 of token


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprobOut]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]


class CallOut(msgspec.Struct):
    name: str
    arguments: str  # JSON text


class ToolCallOut(msgspec.Struct):
    id: str
    function: CallOut
    type: str = "function"


class AssistantMessage(msgspec.Struct, omit_defaults=True):
    content: str | None  # None when the answer is only tool calls
    role: str  # "assistant"
    tool_calls: list[ToolCallOut] | None = None  # left out when there are none


class CallDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    index: int  # the call's place in the choice's list of calls
    id: str | None = None
    type: str | None = None
    function: CallDelta | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# ---------------------------------------------------------------- /v1/models, /health


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    max_model_len: int
    owned_by: str = "gapless"
    family: str = ""  # the decoder family served (llama, qwen3, gemma2, mixtral, ...)
    parent: str | None = None  # a LoRA adapter's: the served model it runs on (never its path)


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


class Health(msgspec.Struct):
    # "ok", "draining" (SIGTERM came), "unresponsive" (no core heartbeat), "stalled" (the
    # runner owes a step's result past the stall bound) or "dead"
    status: str
    reason: str | None = None


# ---------------------------------------------------------------- logprob shapes


def completion_logprobs(
    items: list[TokenLogprob], text_offset: int, first_prompt_token: str | None = None
) -> CompletionLogprobs:
    """The legacy shape; text_offset is where the first token's text starts in the choice.
    With first_prompt_token (echo), that token opens the lists with no logprob."""
    offsets = []
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    if first_prompt_token is not None:
        offsets.append(text_offset)
        text_offset += len(first_prompt_token)
        tokens.append(first_prompt_token)
        token_logprobs.append(None)
        top_logprobs.append(None)
    for item in items:
        offsets.append(text_offset)
        text_offset += len(item.token)
        tokens.append(item.token)
        token_logprobs.append(item.logprob)
        top_logprobs.append({top.token: top.logprob for top in item.top})
    return CompletionLogprobs(tokens, token_logprobs, top_logprobs, offsets)


def chat_logprobs(items: list[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=item.token,
                logprob=item.logprob,
                bytes=list(item.token.encode()),
                top_logprobs=[
                    TopLogprobOut(top.token, top.logprob, list(top.token.encode()))
                    for top in item.top
                ],
            )
            for item in items
        ]
    )
