from __future__ import annotations

import pytest

from gapless.detokenizer.state import DetokenizerState
from tests.detokenizer.util import EOS, chunks, make_new, step, stream, text_of

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


def test_eos_from_the_core_is_counted_but_has_no_text(tokenizer):
    ids = tokenizer.encode("Paris.").ids
    state = DetokenizerState(tokenizer)
    state.add(make_new(skip_special_tokens=False))  # even when shown, the stop token is cut
    deltas, _ = stream(state, "r0", [ids[:1], [*ids[1:], EOS]], finish="stop")
    assert text_of(deltas) == "Paris."
    assert deltas[-1].finish_reason == "stop"
    assert deltas[-1].token_ids[-1] == EOS
    assert deltas[-1].num_output_tokens == len(ids) + 1


def test_ordinary_stop_token_text_is_excluded(tokenizer):
    ids = tokenizer.encode("One. Two.").ids
    state = DetokenizerState(tokenizer)
    state.add(make_new(stop_token_ids=(ids[-1],)))
    deltas, _ = stream(state, "r0", [[i] for i in ids], finish="stop")
    assert text_of(deltas) == "One. Two"


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


@pytest.mark.parametrize("reason", ["abort", "length"])
def test_pure_finish_without_tokens(tokenizer, reason: str):
    state = DetokenizerState(tokenizer)
    state.add(make_new())
    step(state, [("r0", tokenizer.encode("hi").ids, "")])
    (delta,) = step(state, [("r0", [], reason)]).deltas[0]
    assert (delta.text, delta.finish_reason, delta.token_ids) == ("", reason, [])
    assert state.num_requests == 0
