"""Prompts of an exact token length, made of random ordinary words and checked on the tokenizer."""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer

from gapless.bench.words import WORDS


class PromptMaker:
    """Counts tokens as the server will (BOS included when the model adds one) and builds text
    prompts of exactly a given length."""

    def __init__(self, tokenizer: Tokenizer, add_bos: bool = False) -> None:
        self.tokenizer = tokenizer
        self.num_special = 1 if add_bos else 0

        def ntok(text: str) -> int:
            return len(tokenizer.encode(text, add_special_tokens=False).ids)

        # why: words that are one token both alone and after a space make lengths exact by
        # construction; the check below still catches tokenizers where they merge
        single = [w for w in dict.fromkeys(WORDS) if ntok(w) == 1 and ntok(" " + w) == 1]
        self.words = single or list(dict.fromkeys(WORDS))

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids) + self.num_special

    def count_many(self, texts: list[str]) -> list[int]:
        encoded = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return [len(e.ids) + self.num_special for e in encoded]

    def make(self, num_tokens: int, rng: np.random.Generator, suffix: str = "") -> str:
        """Random words then `suffix`, exactly `num_tokens` tokens in all."""
        floor = self.count(suffix) if suffix else self.num_special
        if num_tokens <= floor:
            raise ValueError(
                f"cannot build a {num_tokens}-token prompt (the minimum is {floor + 1})"
            )
        words: list[str] = []
        count = floor
        for _ in range(64):
            if count < num_tokens:
                picks = rng.integers(0, len(self.words), size=num_tokens - count)
                words.extend(self.words[i] for i in picks)
            elif count > num_tokens:
                del words[-max(1, (count - num_tokens) // 2) :]
            else:
                return self._join(words, suffix)
            count = self.count(self._join(words, suffix))
        raise ValueError(f"could not hit exactly {num_tokens} tokens with this tokenizer")

    def make_many(
        self, lengths: list[int], rng: np.random.Generator, suffixes: list[str] | None = None
    ) -> list[str]:
        """`make` for many prompts, checked in one batch; only misses are rebuilt one by one."""
        suffixes = suffixes or [""] * len(lengths)
        floors = self.count_many(suffixes)
        texts = []
        for n, floor, suffix in zip(lengths, floors, suffixes, strict=True):
            picks = rng.integers(0, len(self.words), size=max(0, n - floor))
            texts.append(self._join([self.words[i] for i in picks], suffix))
        counts = self.count_many(texts)
        for i, (n, count) in enumerate(zip(lengths, counts, strict=True)):
            if count != n:
                texts[i] = self.make(n, rng, suffixes[i])
        return texts

    @staticmethod
    def _join(words: list[str], suffix: str) -> str:
        body = " ".join(words)
        return f"{body} {suffix}" if suffix and body else body or suffix

    def truncate(self, text: str, limit: int, keep_tail: int = 64) -> str:
        """`text` cut to at most `limit` tokens by dropping from the middle; its last
        `keep_tail` tokens (the question of a document QA prompt) stay."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        budget = limit - self.num_special
        tail = ids[-keep_tail:] if keep_tail < budget // 2 else []
        for _ in range(8):
            if len(ids) + self.num_special <= limit:
                return text
            head = ids[: max(0, budget - len(tail))]
            text = self.tokenizer.decode(head + tail)
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
            budget -= 4
        raise ValueError(f"could not cut a prompt down to {limit} tokens")
