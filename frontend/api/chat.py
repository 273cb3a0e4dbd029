"""POST /v1/chat/completions."""

from __future__ import annotations

from gapless.common.config import EngineConfig
from gapless.common.messages import TextDelta
from gapless.frontend.api.generation import ChoiceResult
from gapless.frontend.api.openai_fields import CHAT_REFUSED
from gapless.frontend.api.params import check_logprobs
from gapless.frontend.api.prelude import Prelude, Route
from gapless.frontend.api.protocol import ChatCompletionRequest
from gapless.frontend.api.replies import (
    AssistantMessage,
    CallDelta,
    CallOut,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ToolCallDelta,
    ToolCallOut,
    Usage,
    chat_logprobs,
)
from gapless.frontend.api.state import FrontendState
from gapless.frontend.api.tool_parsers import Parsed, ToolParser, make_parser
from gapless.frontend.api.tools import plan_tools, template_messages
from gapless.frontend.engine.tenants import Caller
from gapless.frontend.http.asgi import HttpRequest, Responder, encoder
from gapless.frontend.http.errors import bad_request


class ChatChunks:
    """`chat.completion.chunk`s: each choice opens with the assistant role and empty content.
    With a tool parser, each choice's text goes through its reader: content as it can be sent,
    each call whole once complete, and finish_reason tool_calls if it made any."""

    def __init__(
        self,
        response_id: str,
        created: int,
        model: str,
        logprobs: bool,
        parser: ToolParser | None = None,
        n: int = 1,
    ) -> None:
        self._head = (response_id, created, model)
        self._logprobs = logprobs
        self._readers = [parser.reader() for _ in range(n)] if parser is not None else None
        self._num_calls = [0] * n
        # per choice: a text-only chunk's bytes around its content, when chunks can be so
        self._around: list[tuple[bytes, bytes] | None] = [None] * n
        self._plain = not logprobs and parser is None

    def opening(self, index: int, first: TextDelta) -> bytes | None:
        return self._encode([ChatChunkChoice(index, ChatDelta(role="assistant", content=""))])

    def plain(self, index: int, delta: TextDelta) -> bytes | None:
        if not self._plain or delta.finish_reason is not None:
            return None
        around = self._around[index] or self._split(index)
        return around[0] + encoder.encode(delta.text) + around[1]

    def delta(self, index: int, delta: TextDelta) -> bytes | None:
        if (chunk := self.plain(index, delta)) is not None:  # the usual chunk: text only
            return chunk
        logprobs = chat_logprobs(delta.logprobs or []) if self._logprobs else None
        text, calls, reason = delta.text, None, delta.finish_reason
        if self._readers is not None:
            reader = self._readers[index]
            parsed = reader.feed(delta.text)
            if reason is not None:
                rest = reader.finish(cut=reason == "length")
                parsed = Parsed(parsed.content + rest.content, parsed.calls + rest.calls)
            text = parsed.content
            if parsed.calls:
                first = self._num_calls[index]
                self._num_calls[index] += len(parsed.calls)
                calls = [
                    ToolCallDelta(first + i, c.id, "function", CallDelta(c.name, c.arguments))
                    for i, c in enumerate(parsed.calls)
                ]
            if reason == "stop" and self._num_calls[index]:
                reason = "tool_calls"
            if not text and calls is None and reason is None and logprobs is None:
                return None
        content = text if text or reason is None else None
        choice = ChatChunkChoice(
            index, ChatDelta(content=content, tool_calls=calls), logprobs, reason
        )
        return self._encode([choice])

    def usage(self, usage: Usage) -> bytes:
        return self._encode([], usage)

    def _split(self, index: int) -> tuple[bytes, bytes]:
        """A text-only chunk's encoding cut around its content string, so each later one is
        two concatenations and the text's own encoding (the same bytes as encoding the whole
        chunk, for less; bench/RESULTS.md, "The frontend's fan-out profile"). Inside a JSON
        string every quote is escaped, so the marker is found only where the content is."""
        whole = self._encode([ChatChunkChoice(index, ChatDelta(content=""))])
        head, marker, tail = whole.rpartition(b'"content":""')
        assert marker, whole
        self._around[index] = around = (head + b'"content":', tail)
        return around

    def _encode(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
        rid, created, model = self._head
        chunk = ChatCompletionChunk(
            id=rid, created=created, model=model, choices=choices, usage=usage
        )
        return encoder.encode(chunk)


def _message(
    text: str, reason: str | None, parser: ToolParser | None
) -> tuple[AssistantMessage, str | None]:
    """The whole answer as a message, and its finish_reason (tool_calls if it made calls)."""
    if parser is None:
        return AssistantMessage(text, "assistant"), reason
    parsed = parser.parse(text, cut=reason == "length")
    if not parsed.calls:
        return AssistantMessage(text, "assistant"), reason
    calls = [ToolCallOut(c.id, CallOut(c.name, c.arguments)) for c in parsed.calls]
    content = parsed.content if parsed.content.strip() else None
    return AssistantMessage(
        content, "assistant", calls
    ), "tool_calls" if reason == "stop" else reason


def _logprobs(body: ChatCompletionRequest, config: EngineConfig) -> int | None:
    """SamplingParams.logprobs: None, or how many alternatives to return with each token."""
    if not body.logprobs:
        if body.top_logprobs is not None:
            raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
        return None
    return check_logprobs(body.top_logprobs or 0, "top_logprobs", config)


def _budget(body: ChatCompletionRequest) -> tuple[int | None, str]:
    if body.max_completion_tokens is not None:
        return body.max_completion_tokens, "max_completion_tokens"
    return body.max_tokens, "max_tokens"


CHAT = Route("chat", ChatCompletionRequest, CHAT_REFUSED, "chatcmpl", _budget, _logprobs)


async def handle_chat(
    state: FrontendState, req: HttpRequest, out: Responder, caller: Caller
) -> None:
    pre = await Prelude.read(state, req, out, caller, CHAT)
    body, prompter, logprobs = pre.body, state.prompter, pre.logprobs
    tools = await plan_tools(body, prompter.grammars, pre.tenant)
    grammar = await prompter.grammars.response_format(body.response_format, pre.tenant)
    if grammar is not None and tools.grammar is not None:
        raise bad_request(
            "response_format cannot be combined with a required or named tool_choice",
            param="response_format",
        )
    grammar = grammar or tools.grammar
    if grammar is not None:
        pre.sampling["grammar"] = grammar
    parser = make_parser(state.config.tool_call_parser) if tools.read_calls else None
    parallel = body.parallel_tool_calls is not False
    messages = template_messages(body.messages, tools, prompter.chat_template.takes_tools, parallel)

    def build(choices: list[ChoiceResult], usage: Usage) -> ChatCompletion:
        out_choices = []
        for i, c in enumerate(choices):
            message, reason = _message(c.text, c.finish_reason, parser)
            lp = chat_logprobs(c.logprobs) if logprobs is not None else None
            out_choices.append(ChatChoice(i, message, lp, reason))
        return ChatCompletion(
            id=pre.response_id,
            created=pre.created,
            model=pre.model,
            choices=out_choices,
            usage=usage,
        )

    with pre.admit() as ticket:
        prompt_ids = await prompter.chat_ids(
            messages,
            tools=tools.offered if prompter.chat_template.takes_tools else None,
            documents=body.documents,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            kwargs=body.chat_template_kwargs,
        )
        prediction = await prompter.prediction_ids(body.prediction)
        params = pre.params(prompt_ids, "messages")
        pre.admit_tokens(ticket, [prompt_ids, prediction])
        job = pre.job(ticket, [prompt_ids], [params])
        job.prediction = prediction
        fmt = ChatChunks(
            pre.response_id, pre.created, pre.model, logprobs is not None, parser, pre.n
        )
        await pre.respond(job, fmt, build)
