"""Tool calls in generated text, one parser per format behind a small interface; the server's
`--tool-call-parser` picks one.

A parser turns the whole text into content and calls (`parse`), and makes a streaming reader
(`reader`) that takes text as it comes and returns what can be sent now: content, and each call
once its text is complete (a call goes out whole, in one delta, which the openai client
assembles like any other). A text cut short (finish_reason length, `cut`) still reports the
call it was writing once its name is whole, with its arguments as far as they came.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from gapless.frontend.http.json_depth import deeper_than


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass
class Parsed:
    content: str
    calls: list[ParsedCall]


class StreamReader(Protocol):
    def feed(self, text: str) -> Parsed:
        """What of the text so far can be sent now (content held back while it could still
        start a call)."""
        ...

    def finish(self, cut: bool = False) -> Parsed:
        """The rest, at the end of the output (cut: it ended at max_tokens)."""
        ...


class ToolParser(Protocol):
    def parse(self, text: str, cut: bool = False) -> Parsed: ...

    def reader(self) -> StreamReader: ...


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as Hermes, Qwen and others
    write them; text outside the tags is content. A block that does not hold a call's JSON stays
    in the content, so nothing the model wrote is lost."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str, cut: bool = False) -> Parsed:
        reader = self.reader()
        first = reader.feed(text)
        rest = reader.finish(cut)
        return Parsed(first.content + rest.content, first.calls + rest.calls)

    def reader(self) -> _HermesReader:
        return _HermesReader()

    @staticmethod
    def call_of(block: str) -> ParsedCall | None:
        """The call a whole block holds; None if it holds none, or JSON nested past the
        bound (json_depth.py), which stays content."""
        if deeper_than(block):
            return None
        try:
            value = json.loads(block)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        args = value.get("arguments", value.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            if deeper_than(args):
                return None
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return ParsedCall(value["name"], json.dumps(args, ensure_ascii=False))

    @staticmethod
    def started_call(block: str) -> ParsedCall | None:
        """The call a block cut short was writing: `{"name":"NAME","arguments":` and what
        came of the arguments, as written; None before the name is whole."""
        head = _CALL_HEAD.match(block)
        if head is None:
            return None
        try:
            name = json.loads(head.group("name"))
        except ValueError:
            return None
        rest = block[head.end() :]
        args = _ARGS_KEY.match(rest)
        return ParsedCall(name, rest[args.end() :] if args is not None else "")


class _HermesReader:
    def __init__(self) -> None:
        self._buffer = ""  # text not yet sent
        self._inside = False  # after an opening tag

    def feed(self, text: str) -> Parsed:
        self._buffer += text
        content, calls = [], []
        open_, close = HermesParser.OPEN, HermesParser.CLOSE
        while True:
            if not self._inside:
                at = self._buffer.find(open_)
                if at < 0:
                    keep = _partial_suffix(self._buffer, open_)
                    content.append(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                content.append(self._buffer[:at])
                self._buffer = self._buffer[at + len(open_) :]
                self._inside = True
            at = self._buffer.find(close)
            if at < 0:
                break
            block = self._buffer[:at]
            call = HermesParser.call_of(block.strip())
            if call is None:
                content.append(open_ + block + close)
            else:
                calls.append(call)
            self._buffer = self._buffer[at + len(close) :]
            self._inside = False
        return Parsed("".join(content), calls)

    def finish(self, cut: bool = False) -> Parsed:
        """An unclosed block is a call if its JSON is whole (the model stopped at or in the
        closing tag), or if the output was cut while it wrote one; else content."""
        rest, self._buffer = self._buffer, ""
        if not self._inside:
            return Parsed(rest, [])
        self._inside = False
        block = rest[: len(rest) - _partial_suffix(rest, HermesParser.CLOSE)]
        call = HermesParser.call_of(block.strip())
        if call is None and cut:
            call = HermesParser.started_call(block)
        if call is None:
            return Parsed(HermesParser.OPEN + rest, [])
        return Parsed("", [call])


# a call's JSON up to its whole name (a JSON string), then its arguments key
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*(?P<name>"(?:[^"\\]|\\.)*")')
_ARGS_KEY = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of text that begins tag (it may be completed by more text)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


PARSERS: dict[str, type] = {"hermes": HermesParser}


def make_parser(name: str) -> ToolParser:
    return PARSERS[name]()
