"""Builders of detokenizer inputs for tests."""

from __future__ import annotations

from gapless.common.messages import (
    DetokNew,
    SampleLogprobs,
    SamplingParams,
    TextDelta,
    TokenBatch,
)
from gapless.detokenizer.state import DetokenizerState, Outbox

EOS = 2  # <|im_end|>
ASSISTANT_TAIL = [1, 520, 9531, 198]  # "<|im_start|>assistant\n"

Entry = tuple[str, list[int], str]  # (request id, new token ids, end reason or "")


def make_new(
    request_id: str = "r0", frontend_id: int = 0, prompt_tail: list[int] | None = None, **params
) -> DetokNew:
    params.setdefault("max_tokens", 1000)
    tail = ASSISTANT_TAIL if prompt_tail is None else prompt_tail
    return DetokNew(request_id, frontend_id, SamplingParams(**params), tail)


def lp(logprob: float, *top: tuple[int, float]) -> SampleLogprobs:
    """One token's logprobs: its own, then (id, logprob) pairs best first."""
    return SampleLogprobs(logprob, [t for t, _ in top], [v for _, v in top])


def make_batch(
    entries: list[Entry],
    num_prompt_tokens: int = 7,
    logprobs: list[SampleLogprobs | None] | None = None,
    errors: list[str] | None = None,
) -> TokenBatch:
    """entries: (request id, new token ids, end reason or ""). logprobs, when given, has one
    entry per token of the batch, in token order (None for a request that asked none)."""
    token_ids = [t for e in entries for t in e[1]]
    if logprobs is not None:
        assert len(logprobs) == len(token_ids), "logprobs must be aligned with the tokens"
    if errors is not None:
        assert len(errors) == len(entries), "errors must have one entry per request"
    return TokenBatch(
        request_ids=[e[0] for e in entries],
        counts=[len(e[1]) for e in entries],
        token_ids=token_ids,
        finish_reasons=[e[2] for e in entries],
        num_prompt_tokens=[num_prompt_tokens] * len(entries),
        logprobs=logprobs or [],
        errors=errors or [],
    )


def step(state: DetokenizerState, entries: list[Entry], **kwargs) -> Outbox:
    out = Outbox()
    state.process(make_batch(entries, **kwargs), out)
    return out


def deltas_of(out: Outbox) -> list[TextDelta]:
    return [d for ds in out.deltas.values() for d in ds]


def chunks(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """ids cut into pieces of the given sizes, cycling through them."""
    out, pos, k = [], 0, 0
    while pos < len(ids):
        out.append(ids[pos : pos + sizes[k % len(sizes)]])
        pos += sizes[k % len(sizes)]
        k += 1
    return out


def stream(
    state: DetokenizerState, request_id: str, pieces: list[list[int]], end: str = "length"
) -> tuple[list[TextDelta], list[str]]:
    """Feeds pieces one step each, the last step with end; returns deltas and stop hits."""
    deltas: list[TextDelta] = []
    hits: list[str] = []
    for k, piece in enumerate(pieces):
        out = step(state, [(request_id, piece, end if k == len(pieces) - 1 else "")])
        deltas += deltas_of(out)
        hits += out.stop_hits
    return deltas, hits


def text_of(deltas: list[TextDelta]) -> str:
    return "".join(d.text for d in deltas)
