"""Prompts to token ids: completion prompts as given, chat messages through the template.

A text longer than the model could ever accept is refused before it is tokenized
(`max_prompt_chars`). A text under that cap can still hold several tokens per character (byte
fallback), and a tokenizer keeps ~140 bytes per token, so a long one is first counted a piece
of PIECE_CHARS at a time and refused as soon as the count passes the context; only a text that
fits is tokenized whole, so the memory tokenizing takes is bounded by the context, not the body.
Tokenizing runs in an executor thread through `encode_batch_fast`, which
releases the GIL while it works (`encode` holds it throughout, so the event loop would stop for
as long as a long prompt takes) and keeps no character offsets (freeing them takes the GIL
again).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import tokenizers

from gapless.common.config import EngineConfig
from gapless.frontend.api.chat_template import ChatTemplate
from gapless.frontend.api.protocol import Prediction
from gapless.frontend.api.structured import Grammars
from gapless.frontend.http import metrics
from gapless.frontend.http.errors import bad_request

CompletionPrompt = str | list[int | str | list[int]]
# why: a normalizer (NFC, say) may merge several characters into one before the tokens are cut
NORMALIZED_SLACK = 4
PIECE_CHARS = 32_768  # characters a long text is counted by; at most ~4 tokens each
CUT_SLACK = 8  # tokens that cutting a text in two may add to its count, at most


class TooManyTokens(Exception):
    """A text's tokens passed the context while it was counted piece by piece."""

    def __init__(self, at_least: int) -> None:
        super().__init__(at_least)
        self.at_least = at_least


def max_prompt_chars(tokenizer: tokenizers.Tokenizer, max_model_len: int) -> int:
    """Characters past which no text fits in max_model_len tokens: no token covers more of
    the text than the vocabulary's longest token has characters (a byte-level token's string
    has one character per byte, so never fewer than the text it covers), times
    NORMALIZED_SLACK if the tokenizer normalizes the text first."""
    longest = max(map(len, tokenizer.get_vocab(with_added_tokens=True)), default=1)
    slack = 1 if tokenizer.normalizer is None else NORMALIZED_SLACK
    return max_model_len * max(longest, 1) * slack


class Prompter:
    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        config: EngineConfig,
        executor: Executor | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self._executor = executor
        model = config.model

        def token_text(token_id: int | None) -> str:
            return (tokenizer.id_to_token(token_id) or "") if token_id is not None else ""

        self.grammars = Grammars(tokenizer, config, executor)
        self.max_chars = max_prompt_chars(tokenizer, model.max_model_len)
        source = model.chat_template
        if config.chat_template is not None:
            source = Path(config.chat_template).read_text(encoding="utf-8")
        self.chat_template = ChatTemplate(
            source,
            bos_token=token_text(model.bos_token_id),
            eos_token=token_text(model.eos_token_ids[0] if model.eos_token_ids else None),
            timeout_s=config.chat_template_timeout_s,
            max_chars=min(8 * config.max_body_bytes, self.max_chars),
            executor=executor,
        )

    async def completion_prompts(self, prompt: CompletionPrompt) -> list[list[int]]:
        """Token ids of each prompt of a /v1/completions request (one, or a batch); BOS is added
        to text only if the model asks."""
        prompts = _prompts(prompt)
        if len(prompts) > self.config.max_prompts:
            raise bad_request(
                f"prompt holds {len(prompts)} prompts; at most {self.config.max_prompts}",
                param="prompt",
            )
        return [await self._one_prompt(p) for p in prompts]

    async def completion_ids(self, prompt: CompletionPrompt) -> list[int]:
        """Token ids of a one-prompt request; a batch is refused."""
        prompts = _prompts(prompt)
        if len(prompts) != 1:
            raise bad_request(f"prompt holds {len(prompts)} prompts; one is needed", param="prompt")
        return await self._one_prompt(prompts[0])

    async def _one_prompt(self, one: str | list[int]) -> list[int]:
        if isinstance(one, str):
            if not one:
                raise bad_request("prompt must not be empty", param="prompt")
            self._check_length(one, "prompt")
            t0 = time.perf_counter()
            bos = self.config.model.bos_token_id if self.config.model.add_bos_token else None
            ids = await self._encode(one, bos, "prompt")
            metrics.observer.tokenized(time.perf_counter() - t0)
            return ids
        if not one:
            raise bad_request("prompt must not be empty", param="prompt")
        vocab = self.config.model.vocab_size
        for i in one:
            if not 0 <= i < vocab:
                raise bad_request(
                    f"prompt holds token id {i}, outside the vocabulary [0, {vocab})",
                    param="prompt",
                )
        return one

    async def bad_words_ids(self, words: list[str] | None) -> tuple[tuple[int, ...], ...]:
        """Each bad word as token ids, both as written and after a space (how it appears
        mid-sentence with a byte-level BPE)."""
        out: dict[tuple[int, ...], None] = {}
        for word in words or ():
            if not word.strip():
                raise bad_request("bad_words must not hold empty words", param="bad_words")
            self._check_length(word, "bad_words")
            for variant in (word, " " + word.lstrip()):
                ids = tuple(await self._encode(variant, None, "bad_words"))
                if ids:
                    out[ids] = None
        return tuple(out)

    async def prediction_ids(self, prediction: Prediction | None) -> list[int]:
        """A `prediction`'s ids (text or text parts): at most the context length."""
        if prediction is None:
            return []
        content = prediction.content
        text = content if isinstance(content, str) else "".join(p.text for p in content)
        if not text:
            return []
        self._check_length(text, "prediction")
        ids = await self._encode(text, None, "prediction")
        limit = self.config.model.max_model_len
        if len(ids) > limit:
            raise bad_request(
                f"prediction is {len(ids)} tokens; it may be at most the context length of "
                f"{limit} tokens",
                param="prediction",
                code="context_length_exceeded",
            )
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    async def chat_ids(self, messages: list[dict[str, Any]], **render: Any) -> list[int]:
        """Token ids of the rendered conversation (message dicts, `frontend.api.tools`); render
        holds the template's other arguments. The template already holds special tokens."""
        if not messages:
            raise bad_request("messages must not be empty", param="messages")
        t0 = time.perf_counter()
        text = await self.chat_template.render(messages, **render)
        self._check_length(text, "messages")
        ids = await self._encode(text, None, "messages")
        metrics.observer.tokenized(time.perf_counter() - t0)
        return ids

    def _check_length(self, text: str, param: str) -> None:
        if len(text) > self.max_chars:
            limit = self.config.model.max_model_len
            raise bad_request(
                f"{param} is {len(text)} characters; no text longer than {self.max_chars} "
                f"characters fits the context length of {limit} tokens",
                param=param,
                code="context_length_exceeded",
            )

    async def _encode(self, text: str, bos: int | None, param: str) -> list[int]:
        loop = asyncio.get_running_loop()
        try:
            ids = await loop.run_in_executor(self._executor, self._ids, text)
        except TooManyTokens as e:
            limit = self.config.model.max_model_len
            raise bad_request(
                f"{param} is at least {e.at_least} tokens; it must be shorter than the context "
                f"length of {limit} tokens",
                param=param,
                code="context_length_exceeded",
            ) from None
        return [bos, *ids] if bos is not None else ids

    def _ids(self, text: str) -> list[int]:
        """The text's ids; TooManyTokens once a long text is known to pass the context."""
        encode = self.tokenizer.encode_batch_fast
        if len(text) > PIECE_CHARS:
            limit, count = self.config.model.max_model_len, 0
            for k, piece in enumerate(text_pieces(text, PIECE_CHARS)):
                count += len(encode([piece], False, False)[0].ids)
                at_least = count - CUT_SLACK * k  # why: each cut may split a token or two
                if at_least > limit:
                    raise TooManyTokens(at_least)
        return encode([text], False, False)[0].ids


def text_pieces(text: str, size: int) -> list[str]:
    """text cut into pieces of at most `size` characters, each cut before a whitespace
    character where one is in the piece's second half (a word is then never cut)."""
    pieces, start = [], 0
    while len(text) - start > size:
        end = start + size
        cut = max(text.rfind(" ", start + size // 2, end), text.rfind("\n", start + size // 2, end))
        if cut <= start:
            cut = end
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def _prompts(prompt: CompletionPrompt) -> list[str | list[int]]:
    """The prompts a request carries: text, token ids, or a list of either."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    if all(isinstance(x, int) for x in prompt):
        return [prompt]  # type: ignore[list-item]
    if any(isinstance(x, int) for x in prompt):
        raise bad_request("prompt mixes token ids with strings or lists", param="prompt")
    return list(prompt)  # type: ignore[arg-type]
