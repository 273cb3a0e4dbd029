"""A text-only SSE chunk built from its cached surroundings is the chunk's own encoding."""

from __future__ import annotations

import json

import msgspec
import pytest

from gapless.common.messages import TextDelta
from gapless.frontend.api.chat import ChatChunks
from gapless.frontend.api.completions import CompletionChunks
from gapless.frontend.api.replies import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    Completion,
    CompletionChoice,
)
from gapless.frontend.http.asgi import encoder

TEXTS = [" word", "", 'say "content":"" \\ \n\t\x00', "naïve 漢字 🙂", "</s>"]
# a model name that holds the marker the split looks for, escaped as JSON
MODEL = 'evil"content":""text":""'


def _delta(text: str) -> TextDelta:
    return TextDelta("r-0", text, [7], 3, 1)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("index", [0, 2])
def test_chat_text_chunk_is_the_whole_encoding(text: str, index: int) -> None:
    chunks = ChatChunks("chatcmpl-1", 1700000000, MODEL, logprobs=False, n=3)
    got = [chunks.delta(index, _delta(text)) for _ in range(2)]  # split, then cached
    whole = encoder.encode(
        ChatCompletionChunk(
            id="chatcmpl-1",
            created=1700000000,
            model=MODEL,
            choices=[ChatChunkChoice(index, ChatDelta(content=text))],
        )
    )
    assert got == [whole, whole]
    assert json.loads(whole)["choices"][0]["delta"]["content"] == text


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("index", [0, 2])
def test_completion_text_chunk_is_the_whole_encoding(text: str, index: int) -> None:
    chunks = CompletionChunks("cmpl-1", 1700000000, MODEL, 3, logprobs=False)
    got = [chunks.delta(index, _delta(text)) for _ in range(2)]
    whole = encoder.encode(
        Completion(
            id="cmpl-1",
            created=1700000000,
            model=MODEL,
            choices=[CompletionChoice(index, text)],
        )
    )
    assert got == [whole, whole]
    assert msgspec.json.decode(whole)["choices"][0]["text"] == text


def test_finishing_and_logprob_chunks_take_the_full_path() -> None:
    chunks = ChatChunks("chatcmpl-1", 1, "m", logprobs=False)
    last = json.loads(chunks.delta(0, TextDelta("r-0", "end", [7], 3, 2, "length")))  # type: ignore[arg-type]
    assert last["choices"][0] == {
        "index": 0,
        "delta": {"content": "end"},
        "logprobs": None,
        "finish_reason": "length",
    }
    empty_last = json.loads(chunks.delta(0, TextDelta("r-0", "", [], 3, 2, "stop")))  # type: ignore[arg-type]
    assert empty_last["choices"][0]["delta"] == {}
