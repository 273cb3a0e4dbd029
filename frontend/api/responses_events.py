"""A streamed response as OpenAI's typed SSE events (`event:` and `data:` lines, each data
with its `type` and `sequence_number`; no [DONE] line).

The order: response.created, response.in_progress; for the answer's text a message item
(output_item.added, content_part.added, output_text.delta..., output_text.done,
content_part.done, output_item.done); for each tool call a function_call item (output_item.added,
function_call_arguments.delta, .done, output_item.done); then response.completed, or
response.incomplete when max_output_tokens cut it. A failure after the stream began is an
`error` event, then response.failed. A message item is opened at its first text, so an answer
that is only calls has no empty message.
"""

from __future__ import annotations

from typing import Any

from gapless.common.messages import TextDelta
from gapless.frontend.api.responses_input import item_id
from gapless.frontend.api.tool_parsers import Parsed, ToolParser
from gapless.frontend.http.asgi import encoder

Item = dict[str, Any]


def text_message(text: str, id: str | None = None, status: str = "completed") -> Item:
    return {
        "type": "message",
        "id": id or item_id("msg"),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> Item:
    return {
        "type": "function_call",
        "id": item_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(text: str, reason: str | None, parser: ToolParser | None) -> list[Item]:
    """A whole answer's output items: its text as a message (unless it is only calls), then
    one function_call item per call the parser reads."""
    if parser is None:
        return [text_message(text)]
    parsed = parser.parse(text, cut=reason == "length")
    calls = [call_item(c.id, c.name, c.arguments) for c in parsed.calls]
    if calls and not parsed.content.strip():
        return calls
    return [text_message(parsed.content if calls else text), *calls]


class ResponseEvents:
    """One streamed response's events, numbered as they are made."""

    def __init__(self, parser: ToolParser | None) -> None:
        self.sequence = 0
        self.output: list[Item] = []  # items done
        self._reader = parser.reader() if parser is not None else None
        self._message: Item | None = None  # the message item open, while its text comes
        self._text: list[str] = []

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + encoder.encode(data) + b"\n\n"

    def opening(self, snapshot: dict[str, Any]) -> bytes:
        return self.event("response.created", response=snapshot) + self.event(
            "response.in_progress", response=snapshot
        )

    def delta(self, delta: TextDelta) -> bytes:
        """The events of one engine delta; the last one closes every item."""
        text, calls = delta.text, []
        if self._reader is not None:
            parsed = self._reader.feed(delta.text)
            if delta.finish_reason is not None:
                rest = self._reader.finish(cut=delta.finish_reason == "length")
                parsed = Parsed(parsed.content + rest.content, parsed.calls + rest.calls)
            text, calls = parsed.content, parsed.calls
        out = [self._text_delta(text)] if text else []
        for call in calls:
            out.append(self._close_message())
            out.append(self._call(call_item(call.id, call.name, call.arguments)))
        if delta.finish_reason is not None:
            if not self.output and self._message is None:
                out.append(self._text_delta(""))  # an empty answer is an empty message
            out.append(self._close_message())
        return b"".join(out)

    def _text_delta(self, text: str) -> bytes:
        out = b""
        if self._message is None:
            self._message = text_message("", status="in_progress")
            self._text = []
            at = self._at(self._message)
            out += self.event("response.output_item.added", item=self._message, **at)
            part = self._message["content"][0]
            out += self.event("response.content_part.added", part=part, content_index=0, **at)
        self._text.append(text)
        if not text:
            return out
        at = self._at(self._message)
        return out + self.event(
            "response.output_text.delta", delta=text, content_index=0, logprobs=[], **at
        )

    def _close_message(self) -> bytes:
        message = self._message
        if message is None:
            return b""
        self._message = None
        text = "".join(self._text)
        done = text_message(text, message["id"])
        at = self._at(message)
        part = done["content"][0]
        out = self.event("response.output_text.done", text=text, content_index=0, logprobs=[], **at)
        out += self.event("response.content_part.done", part=part, content_index=0, **at)
        out += self.event("response.output_item.done", item=done, **at)
        self.output.append(done)
        return out

    def _call(self, item: Item) -> bytes:
        at = self._at(item)
        added = {**item, "arguments": "", "status": "in_progress"}
        out = self.event("response.output_item.added", item=added, **at)
        args = item["arguments"]
        out += self.event("response.function_call_arguments.delta", delta=args, **at)
        out += self.event(
            "response.function_call_arguments.done", arguments=args, name=item["name"], **at
        )
        out += self.event("response.output_item.done", item=item, **at)
        self.output.append(item)
        return out

    def _at(self, item: Item) -> dict[str, Any]:
        """Where an item is: its id and its place in the output (items done come first)."""
        index = next((i for i, it in enumerate(self.output) if it is item), len(self.output))
        return {"item_id": item["id"], "output_index": index}
