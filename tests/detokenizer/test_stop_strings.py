from __future__ import annotations

from itertools import accumulate

import pytest

from gapless.detokenizer.state import DetokenizerState
from tests.detokenizer.util import EOS, chunks, deltas_of, make_new, step, stream, text_of

TEXT = "The answer is 42.\nSTOP here and more text after it"


def spans_tokens(tokenizer, text: str, stop: str) -> bool:
    """True when no single token of text holds the whole stop string."""
    return all(stop not in tokenizer.decode([i]) for i in tokenizer.encode(text).ids)


@pytest.mark.parametrize("sizes", [[1], [2], [3, 1], [50]], ids=str)
@pytest.mark.parametrize("stop", ["is 42", ".\nSTOP", "answer", "more text"])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_the_text(tokenizer, stop: str, sizes: list[int], include: bool):
    assert spans_tokens(tokenizer, TEXT, stop) or stop == "answer"
    ids = tokenizer.encode(TEXT).ids
    state = DetokenizerState(tokenizer)
    state.add(make_new(stop=(stop,), include_stop_str_in_output=include))
    pieces = chunks(ids, sizes)
    deltas, hits = stream(state, "r0", [*pieces, [EOS]], end="stop_token")
    cut = TEXT.index(stop) + (len(stop) if include else 0)
    assert text_of(deltas) == TEXT[:cut]
    assert hits == ["r0"]
    assert [d.finish_reason for d in deltas].count("stop") == 1
    assert deltas[-1].finish_reason == "stop"
    # usage counts up to the token that completed the stop string, not the ignored ones
    sent = [t for d in deltas for t in d.token_ids]
    assert sent == ids[: len(sent)]
    assert stop in tokenizer.decode(sent) and stop not in tokenizer.decode(sent[:-1])
    assert deltas[-1].num_output_tokens == len(sent)
    assert state.num_requests == 0
    # forgotten at the hit: every later step of the core (the EOS one too) is skipped
    steps_used = next(k + 1 for k, n in enumerate(accumulate(map(len, pieces))) if n >= len(sent))
    assert state.num_unknown == len(pieces) + 1 - steps_used


def test_text_that_could_start_a_stop_is_held_until_it_cannot(tokenizer):
    state = DetokenizerState(tokenizer)
    state.add(make_new(stop=("world peace",)))
    ids = tokenizer.encode("Hello world").ids
    deltas, _ = stream(state, "r0", [[i] for i in ids], end="")
    assert text_of(deltas) == "Hello "  # "world" might still become the stop string
    deltas, _ = stream(state, "r0", [tokenizer.encode(" pea").ids], end="")
    assert text_of(deltas) == ""
    deltas, _ = stream(state, "r0", [tokenizer.encode("!").ids], end="")
    assert text_of(deltas) == "world pea!"


@pytest.mark.parametrize(
    ("end", "reason"), [("length", "length"), ("stop_token", "stop"), ("error", "error")]
)
def test_core_end_flushes_held_text(tokenizer, end: str, reason: str):
    state = DetokenizerState(tokenizer)
    state.add(make_new(stop=("world peace",)))
    ids = tokenizer.encode("Hello world").ids
    last = [EOS] if end == "stop_token" else []
    deltas, hits = stream(state, "r0", [ids, last], end=end)
    assert text_of(deltas) == "Hello world"
    assert deltas[-1].finish_reason == reason and hits == []
    assert state.num_requests == 0


def test_abort_drops_held_text(tokenizer):
    state = DetokenizerState(tokenizer)
    state.add(make_new(stop=("world peace",)))
    ids = tokenizer.encode("Hello world").ids
    deltas, hits = stream(state, "r0", [ids, []], end="abort")
    assert text_of(deltas) == "Hello "  # the client is gone: "world" is never sent
    assert [d.finish_reason for d in deltas] == [None] and hits == []
    assert state.num_requests == 0


def test_several_stop_strings_first_completed_wins(tokenizer):
    text = "alpha beta\n\ngamma END"
    ids = tokenizer.encode(text).ids
    for stops, want in [(("END", "\n\n"), "alpha beta"), (("END", "gam"), "alpha beta\n\n")]:
        state = DetokenizerState(tokenizer)
        state.add(make_new(stop=stops))
        deltas, hits = stream(state, "r0", [[i] for i in ids], end="")
        assert text_of(deltas) == want and hits == ["r0"]
        assert deltas[-1].finish_reason == "stop" and state.num_requests == 0


def test_tokens_after_the_hit_never_reach_the_client(tokenizer):
    state = DetokenizerState(tokenizer)
    state.add(make_new("a", stop=("STOP",)))
    state.add(make_new("b"))
    ids = tokenizer.encode("go STOP").ids
    more = tokenizer.encode(" leaked").ids
    out = step(state, [("a", ids, ""), ("b", ids, "")])
    assert out.stop_hits == ["a"]
    assert [(d.text, d.finish_reason) for d in out.deltas[0]] == [
        ("go ", "stop"),
        ("go STOP", None),
    ]
    assert state.num_requests == 1  # "a" is forgotten at once
    # the core has not seen StreamEnded yet: two more steps of "a" are skipped, unreported
    for k in (1, 2):
        out = step(state, [("a", more, ""), ("b", more, "")])
        assert [(d.request_id, d.text) for d in deltas_of(out)] == [("b", " leaked")]
        assert out.stop_hits == [] and out.failed == []
        assert state.num_unknown == k
    # the core ends "a" on StreamEnded without a word to the detokenizer; "b" runs to its end
    out = step(state, [("b", [], "length")])
    assert [(d.request_id, d.finish_reason) for d in out.deltas[0]] == [("b", "length")]
    assert state.num_requests == 0 and state.num_unknown == 2


def test_stop_string_in_the_step_that_brings_the_stop_token(tokenizer):
    ids = tokenizer.encode("go STOP now").ids
    state = DetokenizerState(tokenizer)
    state.add(make_new(stop=("STOP",)))
    deltas, hits = stream(state, "r0", [[*ids, EOS]], end="stop_token")
    assert text_of(deltas) == "go " and deltas[-1].finish_reason == "stop"
    assert deltas[-1].token_ids == ids[:3] and deltas[-1].num_output_tokens == 3
    assert hits == []  # the core already ended it
    assert state.num_requests == 0


def test_stop_string_completed_in_the_core_final_step(tokenizer):
    state = DetokenizerState(tokenizer)
    state.add(make_new(stop=("STOP",)))
    deltas, hits = stream(state, "r0", [tokenizer.encode("go STOP").ids], end="length")
    assert text_of(deltas) == "go " and deltas[-1].finish_reason == "stop"
    assert hits == []  # the core already ended it
    assert state.num_requests == 0
