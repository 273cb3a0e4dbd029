"""Every live request of the detokenizer, and one TokenBatch turned into per-frontend deltas."""

from __future__ import annotations

from tokenizers import Tokenizer

from gapless.core.common.messages import DetokNew, TextDelta, TokenBatch, TokenLogprob
from gapless.detokenizer.logprobs import LogprobText, skip_tops
from gapless.detokenizer.request import RequestDetokenizer


class Outbox:
    """What one pass over the drained inputs produced, sent once per pass."""

    __slots__ = ("deltas", "stop_hits", "failed")

    def __init__(self) -> None:
        self.deltas: dict[int, list[TextDelta]] = {}  # frontend id -> deltas in arrival order
        self.stop_hits: list[str] = []  # stop strings found: the core finishes these requests
        self.failed: list[str] = []  # ended here with an error: the core aborts these

    def __bool__(self) -> bool:
        return bool(self.deltas or self.stop_hits or self.failed)


class DetokenizerState:
    """Pure logic of the detokenizer process, with no sockets.

    A request lives from its DetokNew until the core sends it a finish reason, even when a stop
    string or an error ended it earlier: its later tokens (and their logprob entries, which
    shift the flat arrays) must still be recognised and skipped.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._requests: dict[str, RequestDetokenizer] = {}
        self._logprobs = LogprobText(tokenizer)
        self.num_unknown = 0  # batch entries for requests never registered (and skipped)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def add(self, new: DetokNew) -> None:
        """Register a request; a repeated DetokNew for a live request keeps its state."""
        if new.request_id not in self._requests:
            self._requests[new.request_id] = RequestDetokenizer(self._tokenizer, new)

    def process(self, batch: TokenBatch, out: Outbox) -> None:
        requests = self._requests
        token_ids, counts = batch.token_ids, batch.counts
        finishes, errors = batch.finish_reasons, batch.errors
        pos = lp_pos = top_pos = 0  # into token_ids, logprobs / top_counts, top_ids
        for i, request_id in enumerate(batch.request_ids):
            n = counts[i]
            ids = token_ids[pos : pos + n]
            pos += n
            finish = finishes[i]
            req = requests.get(request_id)
            if req is None:
                self.num_unknown += 1
                continue
            if finish:
                del requests[request_id]
            logprobs: list[TokenLogprob] | None = None
            try:
                if req.num_top is not None:
                    lp_start, lp_pos = lp_pos, lp_pos + n
                    top_start, top_pos = top_pos, skip_tops(batch, n, lp_start, top_pos)
                    if not req.is_done:
                        logprobs = self._logprobs.build(
                            batch, ids, lp_start, top_start, req.num_top
                        )
                error = errors[i] if errors else ""
                delta = req.step(ids, finish, batch.num_prompt_tokens[i], logprobs, error)
            except Exception as e:  # one request's failure must not end the others
                if req.is_done:
                    continue
                delta = req.fail(
                    f"detokenizer: {type(e).__name__}: {e}", batch.num_prompt_tokens[i]
                )
                if not finish:
                    out.failed.append(request_id)
            if delta is None:
                continue
            box = out.deltas.get(req.frontend_id)
            if box is None:
                box = out.deltas[req.frontend_id] = []
            box.append(delta)
            if req.stop_hit and not finish:
                out.stop_hits.append(request_id)
