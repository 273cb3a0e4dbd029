"""Readable text of single tokens, and a request's TokenLogprob entries from its tokens'
SampleLogprobs."""

from __future__ import annotations

from tokenizers import Tokenizer

from gapless.common.messages import SampleLogprobs, TokenLogprob, TopLogprob

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
        self, ids: list[int], logprobs: list[SampleLogprobs | None], k: int
    ) -> list[TokenLogprob]:
        """Entries for ids, logprobs[j] being ids[j]'s; keeps at most k top entries per token."""
        out: list[TokenLogprob] = []
        text = self.token_text
        for token_id, lp in zip(ids, logprobs, strict=True):
            assert lp is not None, "a request that asked for logprobs got a token without them"
            top = [
                TopLogprob(text(t), v, t)
                for t, v in zip(lp.top_ids[:k], lp.top_logprobs[:k], strict=True)
            ]
            out.append(TokenLogprob(text(token_id), lp.logprob, token_id, top))
        return out
