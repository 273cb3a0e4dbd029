from __future__ import annotations

import pytest

from gapless.detokenizer.state import DetokenizerState
from tests.detokenizer.util import EOS, chunks, deltas_of, make_new, step, stream, text_of

TEXTS = [
    "Hello 世界! 🎉🎉 naïve café — 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "日本語のテキストを分割する。한국어도 있어요.",
    "family: 👩‍👩‍👧‍👦, flags 🇫🇷🇯🇵, skin 👍🏽",
    "def f(x):\n    return x  # ok\n\n\tindented\r\n",
    "مرحبا بالعالم and Ελληνικά",
]
SIZES = [[1], [3, 1, 2, 5], [7], [2, 9, 1]]


@pytest.mark.parametrize("sizes", SIZES, ids=str)
@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_decode(tokenizer, text: str, sizes: list[int]):
    ids = tokenizer.encode(text).ids
    state = DetokenizerState(tokenizer)
    state.add(make_new())
    deltas, _ = stream(state, "r0", [*chunks(ids, sizes), []])
    assert text_of(deltas) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in d.text for d in deltas)
    assert [t for d in deltas for t in d.token_ids] == ids
    assert deltas[-1].finish_reason == "length"
    assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
    assert deltas[-1].num_output_tokens == len(ids)
    assert state.num_requests == 0


def test_first_token_decodes_in_prompt_context(tokenizer):
    ids = tokenizer.encode(" leading space").ids
    state = DetokenizerState(tokenizer)
    state.add(make_new(prompt_tail=tokenizer.encode("word").ids))
    deltas, _ = stream(state, "r0", [[i] for i in ids])
    assert text_of(deltas) == " leading space"


def test_unfinished_character_at_the_end_is_flushed_like_decode(tokenizer):
    ids = tokenizer.encode("ok 🎉").ids[:-1]  # the emoji's last byte never comes
    state = DetokenizerState(tokenizer)
    state.add(make_new())
    deltas, _ = stream(state, "r0", [[i] for i in ids])
    assert text_of(deltas) == tokenizer.decode(ids)
    assert text_of(deltas).endswith("\ufffd")


@pytest.mark.parametrize("sizes", [[1], [2], [9]], ids=str)
def test_eos_from_the_core_is_counted_but_has_no_text(tokenizer, sizes: list[int]):
    ids = tokenizer.encode("Paris. It is the capital.").ids
    state = DetokenizerState(tokenizer)
    state.add(make_new(skip_special_tokens=False))  # even when shown, the stop token is cut
    deltas, hits = stream(state, "r0", chunks([*ids, EOS], sizes), end="stop_token")
    assert text_of(deltas) == "Paris. It is the capital."
    assert deltas[-1].finish_reason == "stop" and hits == []
    assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
    assert [t for d in deltas for t in d.token_ids] == [*ids, EOS]
    assert deltas[-1].num_output_tokens == len(ids) + 1
    assert state.num_requests == 0


def test_eos_text_is_kept_with_include_stop_str_in_output(tokenizer):
    ids = tokenizer.encode("Paris.").ids
    state = DetokenizerState(tokenizer)
    state.add(make_new(skip_special_tokens=False, include_stop_str_in_output=True))
    deltas, _ = stream(state, "r0", [ids[:1], [*ids[1:], EOS]], end="stop_token")
    assert text_of(deltas) == "Paris.<|im_end|>"
    assert deltas[-1].finish_reason == "stop"
    assert deltas[-1].token_ids[-1] == EOS
    assert deltas[-1].num_output_tokens == len(ids) + 1


def test_eos_alone_in_the_last_step_ends_with_no_text(tokenizer):
    ids = tokenizer.encode("Paris").ids
    state = DetokenizerState(tokenizer)
    state.add(make_new())
    deltas, _ = stream(state, "r0", [ids, [EOS]], end="stop_token")
    assert [(d.text, d.token_ids, d.finish_reason) for d in deltas] == [
        ("Paris", ids, None),
        ("", [EOS], "stop"),
    ]
    assert deltas[-1].num_output_tokens == len(ids) + 1


@pytest.mark.parametrize("sizes", [[1], [3]], ids=str)
@pytest.mark.parametrize(("include", "want"), [(False, "One"), (True, "One.")])
def test_ordinary_stop_token_text_is_withheld_unless_included(
    tokenizer, include: bool, want: str, sizes: list[int]
):
    (dot,) = tokenizer.encode(".").ids
    ids = tokenizer.encode("Yes. One.").ids
    assert ids.count(dot) == 2
    ids = ids[: ids.index(dot, ids.index(dot) + 1) + 1]  # the core ends at the second "."
    state = DetokenizerState(tokenizer)
    state.add(make_new(stop_token_ids=(dot,), include_stop_str_in_output=include))
    deltas, hits = stream(state, "r0", chunks(ids, sizes), end="stop_token")
    assert text_of(deltas) == "Yes. " + want  # an earlier "." the core let through is text
    assert deltas[-1].finish_reason == "stop" and hits == []
    assert [t for d in deltas for t in d.token_ids] == ids
    assert deltas[-1].num_output_tokens == len(ids)
    assert state.num_requests == 0


def test_special_tokens_are_skipped_or_shown(tokenizer):
    ids = tokenizer.encode("a<|im_end|>b").ids
    for skip, want in [(True, "ab"), (False, "a<|im_end|>b")]:
        state = DetokenizerState(tokenizer)
        state.add(make_new(skip_special_tokens=skip))
        deltas, _ = stream(state, "r0", [[i] for i in ids])
        assert text_of(deltas) == want


def test_steps_without_text_carry_their_ids_to_the_next_delta(tokenizer):
    ids = tokenizer.encode("🎉").ids
    assert len(ids) > 1
    state = DetokenizerState(tokenizer)
    state.add(make_new())
    out = step(state, [("r0", ids[:1], "")])
    assert not out  # nothing to say yet: no delta
    out = step(state, [("r0", ids[1:], "")])
    (delta,) = out.deltas[0]
    assert delta.text == "🎉" and delta.token_ids == ids and delta.num_output_tokens == len(ids)


@pytest.mark.parametrize("reason", ["length", "error"])
def test_pure_end_without_tokens(tokenizer, reason: str):
    state = DetokenizerState(tokenizer)
    state.add(make_new())
    step(state, [("r0", tokenizer.encode("hi").ids, "")])
    (delta,) = step(state, [("r0", [], reason)]).deltas[0]
    assert (delta.text, delta.finish_reason, delta.token_ids) == ("", reason, [])
    assert delta.num_output_tokens == 1
    assert state.num_requests == 0


def test_abort_sends_nothing_and_forgets_the_request(tokenizer):
    ids = tokenizer.encode(" 🎉").ids
    assert len(ids) > 1
    state = DetokenizerState(tokenizer)
    state.add(make_new("gone", stop=("world peace",)))
    state.add(make_new("stay"))
    # "gone" holds back text that could start its stop string, and half a character
    (delta,) = step(state, [("gone", tokenizer.encode("Hello world").ids, "")]).deltas[0]
    assert delta.text == "Hello "
    assert not step(state, [("gone", ids[:-1], "")])
    out = step(state, [("gone", [], "abort"), ("stay", ids, "")])
    assert [(d.request_id, d.text) for d in deltas_of(out)] == [("stay", " 🎉")]
    assert out.stop_hits == [] and out.failed == []
    assert state.num_requests == 1 and state.num_unknown == 0
    # anything still in flight for it belongs to no request
    out = step(state, [("gone", ids[-1:], ""), ("gone", [], "length")])
    assert not out
    assert state.num_requests == 1 and state.num_unknown == 2
