from __future__ import annotations

import pytest

from gapless.detokenizer.state import DetokenizerState
from tests.detokenizer.util import EOS, chunks, make_new, step, stream, text_of

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
    deltas, hits = stream(state, "r0", [*pieces, [EOS]], finish="stop")
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


def test_text_that_could_start_a_stop_is_held_until_it_cannot(tokenizer):
    state = DetokenizerState(tokenizer)
    state.add(make_new(stop=("world peace",)))
    ids = tokenizer.encode("Hello world").ids
    deltas, _ = stream(state, "r0", [[i] for i in ids], finish="")
    assert text_of(deltas) == "Hello "  # "world" might still become the stop string
    deltas, _ = stream(state, "r0", [tokenizer.encode(" pea").ids], finish="")
    assert text_of(deltas) == ""
    deltas, _ = stream(state, "r0", [tokenizer.encode("!").ids], finish="")
    assert text_of(deltas) == "world pea!"


@pytest.mark.parametrize("reason", ["length", "abort", "stop"])
def test_core_finish_flushes_held_text(tokenizer, reason: str):
    state = DetokenizerState(tokenizer)
    state.add(make_new(stop=("world peace",)))
    ids = tokenizer.encode("Hello world").ids
    last = [EOS] if reason == "stop" else []
    deltas, hits = stream(state, "r0", [ids, last], finish=reason)
    assert text_of(deltas) == "Hello world"
    assert deltas[-1].finish_reason == reason and hits == []


def test_several_stop_strings_first_completed_wins(tokenizer):
    text = "alpha beta\n\ngamma END"
    ids = tokenizer.encode(text).ids
    for stops, want in [(("END", "\n\n"), "alpha beta"), (("END", "gam"), "alpha beta\n\n")]:
        state = DetokenizerState(tokenizer)
        state.add(make_new(stop=stops))
        deltas, hits = stream(state, "r0", [[i] for i in ids], finish="")
        assert text_of(deltas) == want and hits == ["r0"]


def test_tokens_after_the_hit_never_reach_the_client(tokenizer):
    state = DetokenizerState(tokenizer)
    state.add(make_new("a", stop=("STOP",)))
    state.add(make_new("b"))
    ids = tokenizer.encode("go STOP").ids
    more = tokenizer.encode(" leaked").ids
    out = step(state, [("a", ids, ""), ("b", ids, "")])
    assert out.stop_hits == ["a"]
    assert [d.text for d in out.deltas[0]] == ["go ", "go STOP"]
    # the core has not seen StopHit yet: two more steps, then it finishes the request
    for finish in ["", ""]:
        out = step(state, [("a", more, finish), ("b", more, "")])
        assert [d.request_id for d in out.deltas[0]] == ["b"] and out.stop_hits == []
    out = step(state, [("a", [], "stop"), ("b", [], "length")])
    assert [(d.request_id, d.finish_reason) for d in out.deltas[0]] == [("b", "length")]
    assert state.num_requests == 0


def test_stop_string_completed_in_the_core_final_step(tokenizer):
    state = DetokenizerState(tokenizer)
    state.add(make_new(stop=("STOP",)))
    deltas, hits = stream(state, "r0", [tokenizer.encode("go STOP").ids], finish="length")
    assert text_of(deltas) == "go " and deltas[-1].finish_reason == "stop"
    assert hits == []  # the core already ended it
