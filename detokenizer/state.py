"""Every live request of the detokenizer, and one TokenBatch turned into per-frontend deltas."""

from __future__ import annotations

import logging
from typing import get_args

from tokenizers import Tokenizer

from gapless.common.bad_messages import BadMessages
from gapless.common.messages import DetokNew, EndReason, TextDelta, TokenBatch
from gapless.detokenizer.logprobs import LogprobText
from gapless.detokenizer.request import RequestDetokenizer
from gapless.detokenizer.token_table import TokenTable

log = logging.getLogger("gapless.detokenizer")
END_REASONS = frozenset(get_args(EndReason))


class Outbox:
    """What one pass over the drained inputs produced, sent once per pass."""

    __slots__ = ("deltas", "stop_hits", "failed")

    def __init__(self) -> None:
        self.deltas: dict[int, list[TextDelta]] = {}  # frontend id -> deltas in arrival order
        self.stop_hits: list[str] = []  # stop strings ended these streams: the core ends them
        self.failed: list[str] = []  # ended here with an error: the core ends them

    def __bool__(self) -> bool:
        return bool(self.deltas or self.stop_hits or self.failed)


class DetokenizerState:
    """Pure logic of the detokenizer process, with no sockets.

    A request lives from its DetokNew until its stream ends: by the core's end reason, a stop
    string or an error. Tokens the core still sends for it afterwards (steps already in flight)
    belong to no live request and are skipped; each token's logprobs travel beside it, so
    skipping shifts nothing.

    What the core sends is checked here first (common/bad_messages.py): a DetokNew for a
    frontend that does not exist or with ids outside the vocabulary, a TokenBatch whose lists
    do not line up, an end reason the core never sends; each is counted, and the requests it
    names end with an error (the core is told through `Outbox.failed`).
    """

    def __init__(self, tokenizer: Tokenizer, num_frontends: int | None = None) -> None:
        self._tokenizer = tokenizer
        self._num_frontends = num_frontends  # None: any frontend id >= 0
        self._vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bad = BadMessages("detokenizer", log)
        self._requests: dict[str, RequestDetokenizer] = {}
        self._logprobs = LogprobText(tokenizer)
        self._table = TokenTable.of(tokenizer)  # None: not byte-level, the streams decode all
        self.num_unknown = 0  # batch entries for requests not (or no longer) live: skipped

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def add(self, new: DetokNew, out: Outbox | None = None) -> None:
        """Register a request; a repeated DetokNew for a live request keeps its state. One that
        is impossible ends its request with an error (to its frontend, if it has one)."""
        if new.request_id in self._requests:
            return
        fid, tail, vocab = new.frontend_id, new.prompt_tail, self._vocab
        known = fid >= 0 and (self._num_frontends is None or fid < self._num_frontends)
        if known and all(0 <= i < vocab for i in tail):
            self._requests[new.request_id] = RequestDetokenizer(self._tokenizer, new, self._table)
            return
        why = f"frontend {fid}" if not known else f"a prompt tail outside [0, {vocab})"
        self.bad.report("detok_new", f"request {new.request_id!r} with {why}: ended")
        if out is not None:
            out.failed.append(new.request_id)
            if known:
                delta = TextDelta(new.request_id, "", [], 0, 0, "error", None, "impossible request")
                out.deltas.setdefault(fid, []).append(delta)

    def process(self, batch: TokenBatch, out: Outbox) -> None:
        if not self._lines_up(batch):
            self._fail_all(batch, out)
            return
        requests, boxes = self._requests, out.deltas
        token_ids, counts, ends = batch.token_ids, batch.counts, batch.finish_reasons
        num_prompt_tokens = batch.num_prompt_tokens
        # why: an entry with one token and nothing beside it takes the cheaper step_token
        simple = not (
            batch.logprobs
            or batch.errors
            or batch.num_cached_tokens
            or batch.prompt_logprobs
            or batch.embeddings
        )
        pos = 0  # into token_ids and logprobs: past the entry's tokens
        for i, request_id in enumerate(batch.request_ids):
            n = counts[i]
            pos += n
            req = requests.get(request_id)
            if req is None:
                self.num_unknown += 1
                continue
            end = ends[i]
            if end and end not in END_REASONS:
                self.bad.report("end_reason", f"request {request_id!r} ended by {end!r}")
                end = ends[i] = "error"
            try:
                if n == 1 and simple and not end:
                    delta = req.step_token(token_ids[pos - 1], num_prompt_tokens[i])
                else:
                    delta = self._step(req, batch, i, pos - n)
            except Exception as e:  # one request's failure must not end the others
                delta = req.fail(f"detokenizer: {type(e).__name__}: {e}", num_prompt_tokens[i])
                if not end:
                    out.failed.append(request_id)
            if req.is_done:
                del requests[request_id]
                if req.stop_hit and not end:
                    out.stop_hits.append(request_id)
            if delta is not None:
                box = boxes.get(req.frontend_id)
                if box is None:
                    box = boxes[req.frontend_id] = []
                box.append(delta)

    @staticmethod
    def _lines_up(batch: TokenBatch) -> bool:
        """Whether the per-entry lists have one item per entry (lengths only: per step)."""
        n = len(batch.request_ids)
        return (
            len(batch.counts) == len(batch.finish_reasons) == len(batch.num_prompt_tokens) == n
            and len(batch.errors) in (0, n)
            and len(batch.num_cached_tokens) in (0, n)
            and len(batch.prompt_logprobs) in (0, n)
            and len(batch.embeddings) in (0, n)
            and len(batch.logprobs) in (0, len(batch.token_ids))
        )

    def _fail_all(self, batch: TokenBatch, out: Outbox) -> None:
        """A batch whose lists do not line up: every live request it names ends with an error."""
        self.bad.report(
            "token_batch", f"lists of {len(batch.request_ids)} entries do not line up: dropped"
        )
        for request_id in dict.fromkeys(batch.request_ids):
            req = self._requests.pop(request_id, None)
            if req is not None:
                delta = req.fail("detokenizer: an impossible token batch", 0)
                out.deltas.setdefault(req.frontend_id, []).append(delta)
                out.failed.append(request_id)

    def _step(
        self, req: RequestDetokenizer, batch: TokenBatch, i: int, start: int
    ) -> TextDelta | None:
        """Entry i of batch, its tokens starting at token_ids[start], with all it carries."""
        n = batch.counts[i]
        ids = batch.token_ids[start : start + n]
        scored = batch.prompt_logprobs[i] if batch.prompt_logprobs else None
        if scored is not None and req.num_prompt_top is not None:
            req.prompt_logprobs = self._logprobs.build(
                scored.token_ids, list(scored.logprobs), req.num_prompt_top
            )
        token_lps = None
        if req.num_top is not None and batch.logprobs:
            token_lps = self._logprobs.build(ids, batch.logprobs[start : start + n], req.num_top)
        error = batch.errors[i] if batch.errors else ""
        delta = req.step(ids, batch.finish_reasons[i], batch.num_prompt_tokens[i], token_lps, error)
        if delta is not None and batch.num_cached_tokens:
            delta.num_cached_tokens = batch.num_cached_tokens[i]
        if delta is not None and batch.embeddings and batch.embeddings[i]:
            delta.embedding = batch.embeddings[i]
        return delta
