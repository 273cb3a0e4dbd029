from __future__ import annotations

import pytest

from gapless.detokenizer.state import DetokenizerState, Outbox
from tests.detokenizer.util import deltas_of, make_batch, make_new

TEXT = "The quick brown fox jumps over the lazy dog, while 東京 sleeps under 🌙 light. " * 8


def _bench_step(benchmark, tokenizer, batch_size: int, **params) -> None:
    """One decode step: batch_size running requests, one new token each."""
    ids = tokenizer.encode(TEXT).ids
    state = DetokenizerState(tokenizer)
    for r in range(batch_size):
        state.add(make_new(f"r{r}", frontend_id=r % 2, **params))
    batches = [
        make_batch([(f"r{r}", [ids[(k + r) % len(ids)]], "") for r in range(batch_size)])
        for k in range(len(ids))
    ]
    steps = iter(batches * 1000)
    calls = [0]

    def run() -> Outbox:
        calls[0] += 1
        out = Outbox()
        state.process(next(steps), out)
        return out

    out = benchmark(run)
    n = calls[0]
    assert n >= 1
    assert state.num_requests == batch_size and state.num_unknown == 0
    # the last step: at most one delta per request, each ending in that step's token and
    # counting every token the request got so far
    last = batches[(n - 1) % len(batches)]
    deltas = deltas_of(out)
    assert len(deltas) <= batch_size
    assert len({d.request_id for d in deltas}) == len(deltas)
    for d in deltas:
        r = int(d.request_id[1:])
        assert d.token_ids[-1] == last.token_ids[r]
        assert d.num_output_tokens == n and d.finish_reason is None
        assert d.text and not out.stop_hits and not out.failed
    # a step where every token decodes: one delta per request, on its own frontend
    (the,) = tokenizer.encode(" the").ids
    after = Outbox()
    state.process(make_batch([(f"r{r}", [the], "") for r in range(batch_size)]), after)
    deltas = deltas_of(after)
    assert len(deltas) == batch_size
    assert all(d.text.endswith(" the") and d.num_output_tokens == n + 1 for d in deltas)
    assert {f: len(ds) for f, ds in after.deltas.items()} == {
        f: len(range(f, batch_size, 2)) for f in (0, 1) if f < batch_size
    }
    # ending every request reports each once, with all of its tokens counted
    end = Outbox()
    state.process(make_batch([(f"r{r}", [], "length") for r in range(batch_size)]), end)
    deltas = deltas_of(end)
    assert sorted(d.request_id for d in deltas) == sorted(f"r{r}" for r in range(batch_size))
    assert all(d.finish_reason == "length" and d.num_output_tokens == n + 1 for d in deltas)
    assert state.num_requests == 0


def test_bench_detok_step_256(benchmark, tokenizer):
    _bench_step(benchmark, tokenizer, 256)


def test_bench_detok_step_256_stop_strings(benchmark, tokenizer):
    # stop strings that never match nor start in TEXT: every token is scanned, none held back
    _bench_step(benchmark, tokenizer, 256, stop=("<END>", "[[stop]]"))


@pytest.mark.parametrize("batch_size", [1, 32])
def test_bench_detok_step(benchmark, tokenizer, batch_size: int):
    _bench_step(benchmark, tokenizer, batch_size)
