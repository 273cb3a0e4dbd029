"""Every live request of the detokenizer, and one TokenBatch turned into per-frontend deltas."""

from __future__ import annotations

from tokenizers import Tokenizer

from gapless.core.common.messages import DetokNew, TextDelta, TokenBatch
from gapless.detokenizer.logprobs import LogprobText
from gapless.detokenizer.request import RequestDetokenizer
from gapless.detokenizer.token_table import TokenTable


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
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._requests: dict[str, RequestDetokenizer] = {}
        self._logprobs = LogprobText(tokenizer)
        self._table = TokenTable.of(tokenizer)  # None: not byte-level, the streams decode all
        self.num_unknown = 0  # batch entries for requests not (or no longer) live: skipped

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def add(self, new: DetokNew) -> None:
        """Register a request; a repeated DetokNew for a live request keeps its state."""
        if new.request_id not in self._requests:
            self._requests[new.request_id] = RequestDetokenizer(self._tokenizer, new, self._table)

    def process(self, batch: TokenBatch, out: Outbox) -> None:
        requests, boxes = self._requests, out.deltas
        token_ids, counts, ends = batch.token_ids, batch.counts, batch.finish_reasons
        num_prompt_tokens = batch.num_prompt_tokens
        # why: an entry with one token and nothing beside it takes the cheaper step_token
        simple = not (
            batch.logprobs or batch.errors or batch.num_cached_tokens or batch.prompt_logprobs
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
        return delta
