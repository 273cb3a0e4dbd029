from __future__ import annotations

from gapless.common.messages import SampleLogprobs, TokenLogprob, TopLogprob
from gapless.detokenizer.logprobs import LogprobText
from gapless.detokenizer.state import DetokenizerState
from tests.detokenizer.util import EOS, lp, make_new, step


def test_token_text_is_readable(tokenizer):
    texts = LogprobText(tokenizer)
    (the,) = tokenizer.encode(" the").ids
    assert tokenizer.id_to_token(the) == "Ġthe"
    assert texts.token_text(the) == " the"
    assert texts.token_text(EOS) == "<|im_end|>"
    partial = tokenizer.encode("🎉").ids[0]
    assert texts.token_text(partial) == "\ufffd"


def test_logprobs_travel_per_token(tokenizer):
    a, b, c = tokenizer.encode(" the cat sat").ids
    state = DetokenizerState(tokenizer)
    state.add(make_new("top2", logprobs=2))
    state.add(make_new("none"))
    state.add(make_new("only", logprobs=0))
    state.add(make_new("few", logprobs=5))
    out = step(
        state,
        [("top2", [a, b], ""), ("none", [c], ""), ("only", [c], ""), ("few", [a], "")],
        # one per token; "none" asked none
        logprobs=[
            lp(-0.1, (a, -0.1), (c, -2.0)),
            lp(-0.2, (b, -0.2), (a, -1.0), (c, -3.0)),  # more than asked for is cut to k
            None,
            lp(-0.3, (c, -0.3)),  # k = 0: the sampled token only
            lp(-0.4, (a, -0.4)),  # fewer than asked for: what there is
        ],
    )
    top2, none, only, few = out.deltas[0]
    assert top2.logprobs == [
        TokenLogprob(" the", -0.1, a, [TopLogprob(" the", -0.1, a), TopLogprob(" sat", -2.0, c)]),
        TokenLogprob(" cat", -0.2, b, [TopLogprob(" cat", -0.2, b), TopLogprob(" the", -1.0, a)]),
    ]
    assert top2.text == " the cat" and top2.token_ids == [a, b]
    assert none.logprobs is None and none.text == " sat"
    assert only.logprobs == [TokenLogprob(" sat", -0.3, c, [])]
    assert few.logprobs == [TokenLogprob(" the", -0.4, a, [TopLogprob(" the", -0.4, a)])]


def test_a_batch_without_logprobs_leaves_them_out(tokenizer):
    (a,) = tokenizer.encode(" the").ids
    state = DetokenizerState(tokenizer)
    state.add(make_new("r0"))
    (delta,) = step(state, [("r0", [a], "")]).deltas[0]
    assert delta.text == " the" and delta.logprobs is None


def test_a_delta_with_logprobs_is_sent_even_without_text(tokenizer):
    partial = tokenizer.encode("🎉").ids[0]
    state = DetokenizerState(tokenizer)
    state.add(make_new(logprobs=0))
    (delta,) = step(state, [("r0", [partial], "")], logprobs=[lp(-1.5)]).deltas[0]
    assert delta.text == "" and delta.token_ids == [partial]
    assert delta.logprobs == [TokenLogprob("\ufffd", -1.5, partial, [])]


def test_the_withheld_stop_token_keeps_its_logprob(tokenizer):
    (a,) = tokenizer.encode("yes").ids
    state = DetokenizerState(tokenizer)
    state.add(make_new(logprobs=1))
    out = step(state, [("r0", [a, EOS], "stop_token")], logprobs=[lp(-0.5), lp(-0.1, (EOS, -0.1))])
    (delta,) = out.deltas[0]
    assert (delta.text, delta.finish_reason, delta.token_ids) == ("yes", "stop", [a, EOS])
    assert [(t.token_id, t.logprob) for t in delta.logprobs] == [(a, -0.5), (EOS, -0.1)]


def test_tokens_after_a_stop_string_are_skipped_without_disturbing_logprobs(tokenizer):
    ids = tokenizer.encode("x STOP more").ids
    stop_at = next(j for j in range(len(ids)) if "STOP" in tokenizer.decode(ids[: j + 1]))
    assert stop_at < len(ids) - 1  # the stop string completes before the step's last token
    y, z = tokenizer.encode("y z").ids
    state = DetokenizerState(tokenizer)
    state.add(make_new("a", logprobs=1, stop=("STOP",)))
    state.add(make_new("b", logprobs=1))
    state.add(make_new("c"))
    lps = [lp(-1.0 - j, (t, -1.0 - j)) for j, t in enumerate(ids)]
    out = step(
        state, [("a", ids, ""), ("c", [y], ""), ("b", [y], "")], logprobs=[*lps, None, lp(-0.2)]
    )
    a, c, b = out.deltas[0]
    assert out.stop_hits == ["a"]
    # the hit cuts the step: the tokens after it, and their logprobs, are not "a"'s
    assert (a.text, a.finish_reason) == ("x ", "stop")
    assert a.token_ids == ids[: stop_at + 1] and a.num_output_tokens == stop_at + 1
    assert [t.logprob for t in a.logprobs] == [-1.0 - j for j in range(stop_at + 1)]
    assert c.logprobs is None
    assert b.logprobs == [TokenLogprob("y", -0.2, y, [])]
    assert state.num_requests == 2
    # the core's steps already in flight still bring "a" tokens, logprobs beside them
    out = step(
        state,
        [("a", [y, z], ""), ("c", [z], ""), ("b", [y], "")],
        logprobs=[lp(-7.0, (0, -9.0)), lp(-8.0, (0, -9.0)), None, lp(-0.5, (y, -0.5))],
    )
    c, b = out.deltas[0]
    assert (c.request_id, c.text, c.logprobs) == ("c", " z", None)
    assert b.request_id == "b"
    assert b.logprobs == [TokenLogprob("y", -0.5, y, [TopLogprob("y", -0.5, y)])]
    assert out.stop_hits == [] and state.num_unknown == 1


def test_core_error_ends_the_request_with_its_message(tokenizer):
    state = DetokenizerState(tokenizer)
    state.add(make_new("a"))
    state.add(make_new("b"))
    state.add(make_new("c"))
    out = step(
        state,
        [("a", [], "error"), ("b", [], "abort"), ("c", [], "error")],
        errors=["device lost", "", ""],
    )
    a, c = out.deltas[0]  # nothing for "b": its client is gone
    assert (a.request_id, a.finish_reason, a.error) == ("a", "error", "device lost")
    assert (c.request_id, c.finish_reason, c.error) == ("c", "error", "engine error")
    assert out.failed == [] and out.stop_hits == []  # the core ended them itself
    assert state.num_requests == 0


class _BrokenStream:
    def step(self, tokenizer, ids):
        raise RuntimeError("boom")


def _break(state: DetokenizerState, request_id: str) -> None:
    """Every later token of the request fails: it goes to a stream that raises."""
    req = state._requests[request_id]
    req._stream, req._whole = _BrokenStream(), False


def test_a_failing_request_ends_alone(tokenizer):
    ids = tokenizer.encode("fine").ids
    state = DetokenizerState(tokenizer)
    state.add(make_new("bad"))
    state.add(make_new("good"))
    _break(state, "bad")
    out = step(state, [("bad", ids, ""), ("good", ids, "")])
    bad, good = out.deltas[0]
    assert (bad.finish_reason, bad.error) == ("error", "detokenizer: RuntimeError: boom")
    assert good.text == "fine" and good.finish_reason is None
    assert out.failed == ["bad"] and out.stop_hits == []
    assert state.num_requests == 1  # "bad" is forgotten at once
    # the core has not seen StreamEnded yet: its next step for "bad" is skipped
    out = step(state, [("bad", ids, ""), ("good", ids, "")])
    assert [d.request_id for d in out.deltas[0]] == ["good"]
    assert out.failed == [] and state.num_unknown == 1
    assert state.num_requests == 1


def test_a_failure_in_the_core_last_step_is_not_reported_back(tokenizer):
    ids = tokenizer.encode("fine").ids
    state = DetokenizerState(tokenizer)
    state.add(make_new("bad"))
    _break(state, "bad")
    (bad,) = step(state, [("bad", ids, "length")]).deltas[0]
    assert (bad.finish_reason, bad.error) == ("error", "detokenizer: RuntimeError: boom")
    assert state.num_requests == 0


def test_malformed_logprobs_fail_only_their_request(tokenizer):
    a, b = tokenizer.encode(" the cat").ids
    state = DetokenizerState(tokenizer)
    state.add(make_new("bad", logprobs=2))
    state.add(make_new("good", logprobs=1))
    out = step(
        state,
        [("bad", [a], ""), ("good", [b], "")],
        logprobs=[lp(-0.1, (a, -0.1)), lp(-0.2, (b, -0.2))],
    )
    assert [d.text for d in out.deltas[0]] == [" the", " cat"]
    # a malformed top list (ids and logprobs of different lengths) for "bad" only
    out = step(
        state,
        [("bad", [b], ""), ("good", [a], "")],
        logprobs=[SampleLogprobs(-0.3, [a, b], [-0.3]), lp(-0.4, (a, -0.4))],
    )
    bad, good = out.deltas[0]
    assert bad.finish_reason == "error" and bad.error.startswith("detokenizer: ValueError")
    assert bad.num_output_tokens == 1  # its last token was never taken in
    assert good.logprobs == [TokenLogprob(" the", -0.4, a, [TopLogprob(" the", -0.4, a)])]
    assert out.failed == ["bad"] and state.num_requests == 1


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
