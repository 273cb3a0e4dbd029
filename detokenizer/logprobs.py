"""Readable text of single tokens and the per-token logprob entries of a TokenBatch."""

from __future__ import annotations

from tokenizers import Tokenizer

from gapless.core.common.messages import TokenBatch, TokenLogprob, TopLogprob

_METASPACE = "\u2581"  # sentencepiece's word-start mark


class LogprobText:
    """Builds TokenLogprob lists from a batch's flat logprob arrays; token text is cached."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        """One token on its own: "Ġthe" -> " the"; a partial UTF-8 byte gives U+FFFD."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            piece = self._tokenizer.id_to_token(token_id) or ""
            # why: sentencepiece decoders drop the leading space of the first word
            if piece.startswith(_METASPACE) and not text.startswith(" "):
                text = " " + text
            self._texts[token_id] = text
        return text

    def build(
        self, batch: TokenBatch, ids: list[int], lp_pos: int, top_pos: int, k: int
    ) -> list[TokenLogprob]:
        """Entries for ids, whose logprobs start at batch.logprobs[lp_pos] and whose top lists
        start at batch.top_ids[top_pos]; keeps at most k top entries per token."""
        out: list[TokenLogprob] = []
        text = self.token_text
        top_ids, top_lps = batch.top_ids, batch.top_logprobs
        for j, token_id in enumerate(ids):
            n_top = batch.top_counts[lp_pos + j]
            top = [
                TopLogprob(text(top_ids[t]), top_lps[t], top_ids[t])
                for t in range(top_pos, top_pos + min(n_top, k))
            ]
            out.append(TokenLogprob(text(token_id), batch.logprobs[lp_pos + j], token_id, top))
            top_pos += n_top
        return out


def skip_tops(batch: TokenBatch, num_tokens: int, lp_pos: int, top_pos: int) -> int:
    """The top position after num_tokens tokens whose entries nobody needs."""
    return top_pos + sum(batch.top_counts[lp_pos : lp_pos + num_tokens])
