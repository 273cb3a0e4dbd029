from __future__ import annotations

from gapless.core.common.messages import TokenLogprob, TopLogprob
from gapless.detokenizer.logprobs import LogprobText
from gapless.detokenizer.state import DetokenizerState
from tests.detokenizer.util import EOS, make_new, step


def test_token_text_is_readable(tokenizer):
    texts = LogprobText(tokenizer)
    (the,) = tokenizer.encode(" the").ids
    assert tokenizer.id_to_token(the) == "Ġthe"
    assert texts.token_text(the) == " the"
    assert texts.token_text(EOS) == "<|im_end|>"
    partial = tokenizer.encode("🎉").ids[0]
    assert texts.token_text(partial) == "\ufffd"


def test_logprobs_follow_the_flat_arrays(tokenizer):
    a, b, c = tokenizer.encode(" the cat sat").ids
    state = DetokenizerState(tokenizer)
    state.add(make_new("top2", logprobs=2))
    state.add(make_new("none"))
    state.add(make_new("only", logprobs=0))
    out = step(
        state,
        [("top2", [a, b], ""), ("none", [c], ""), ("only", [c], "")],
        # flat over the tokens of top2 (2) and only (1); "none" has no entries
        logprobs=[-0.1, -0.2, -0.3],
        top_counts=[2, 3, 0],  # more than asked for is cut to k
        top_ids=[a, c, b, a, c],
        top_logprobs=[-0.1, -2.0, -0.2, -1.0, -3.0],
    )
    top2, none, only = out.deltas[0]
    assert top2.logprobs == [
        TokenLogprob(" the", -0.1, a, [TopLogprob(" the", -0.1, a), TopLogprob(" sat", -2.0, c)]),
        TokenLogprob(" cat", -0.2, b, [TopLogprob(" cat", -0.2, b), TopLogprob(" the", -1.0, a)]),
    ]
    assert none.logprobs is None
    assert only.logprobs == [TokenLogprob(" sat", -0.3, c, [])]


def test_a_delta_with_logprobs_is_sent_even_without_text(tokenizer):
    partial = tokenizer.encode("🎉").ids[0]
    state = DetokenizerState(tokenizer)
    state.add(make_new(logprobs=0))
    (delta,) = step(state, [("r0", [partial], "")], logprobs=[-1.5], top_counts=[0]).deltas[0]
    assert delta.text == "" and delta.logprobs[0].logprob == -1.5


def test_done_requests_still_consume_their_logprob_entries(tokenizer):
    ids = tokenizer.encode("x STOP").ids
    (y,) = tokenizer.encode("y").ids
    state = DetokenizerState(tokenizer)
    state.add(make_new("a", logprobs=1, stop=("STOP",)))
    state.add(make_new("b", logprobs=1))
    n = len(ids)
    step(state, [("a", ids, "")], logprobs=[-1.0] * n, top_counts=[1] * n, top_ids=ids,
         top_logprobs=[-1.0] * n)  # fmt: skip
    out = step(state, [("a", [y], ""), ("b", [y], "")], logprobs=[-7.0, -0.5],
               top_counts=[1, 1], top_ids=[0, y], top_logprobs=[-9.0, -0.5])  # fmt: skip
    (delta,) = out.deltas[0]
    assert delta.request_id == "b"
    assert delta.logprobs == [TokenLogprob("y", -0.5, y, [TopLogprob("y", -0.5, y)])]


def test_core_error_ends_the_request_with_its_message(tokenizer):
    state = DetokenizerState(tokenizer)
    state.add(make_new("a"))
    state.add(make_new("b"))
    out = step(state, [("a", [], "error"), ("b", [], "abort")], errors=["device lost", ""])
    a, b = out.deltas[0]
    assert (a.finish_reason, a.error) == ("error", "device lost")
    assert (b.finish_reason, b.error) == ("abort", None)


class _BrokenStream:
    def step(self, tokenizer, ids):
        raise RuntimeError("boom")


def test_a_failing_request_ends_alone(tokenizer):
    ids = tokenizer.encode("fine").ids
    state = DetokenizerState(tokenizer)
    state.add(make_new("bad"))
    state.add(make_new("good"))
    state._requests["bad"]._stream = _BrokenStream()
    out = step(state, [("bad", ids, ""), ("good", ids, "")])
    bad, good = out.deltas[0]
    assert (bad.finish_reason, bad.error) == ("error", "detokenizer: RuntimeError: boom")
    assert good.text == "fine" and good.finish_reason is None
    assert out.failed == ["bad"]
    out = step(state, [("bad", ids, "abort"), ("good", ids, "")])
    assert [d.request_id for d in out.deltas[0]] == ["good"]
    assert state.num_requests == 1


def test_deltas_are_grouped_by_frontend_and_unknown_ids_skipped(tokenizer):
    ids = tokenizer.encode("hi").ids
    state = DetokenizerState(tokenizer)
    state.add(make_new("a", frontend_id=1))
    state.add(make_new("b", frontend_id=0))
    state.add(make_new("c", frontend_id=1))
    out = step(state, [("a", ids, ""), ("ghost", ids, ""), ("b", ids, ""), ("c", ids, "")])
    assert {f: [d.request_id for d in ds] for f, ds in out.deltas.items()} == {
        1: ["a", "c"],
        0: ["b"],
    }
    assert state.num_unknown == 1
