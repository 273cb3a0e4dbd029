"""Prompts to token ids: completion prompts as given, chat messages through the template.

Tokenizing runs in an executor thread so a long prompt never stalls the event loop.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from typing import Any

import tokenizers

from gapless.core.common.config import EngineConfig
from gapless.frontend import metrics
from gapless.frontend.chat_template import ChatTemplate
from gapless.frontend.errors import bad_request
from gapless.frontend.protocol import ChatMessage

CompletionPrompt = str | list[int | str | list[int]]


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

        self.chat_template = ChatTemplate(
            model.chat_template,
            bos_token=token_text(model.bos_token_id),
            eos_token=token_text(model.eos_token_ids[0] if model.eos_token_ids else None),
            timeout_s=config.chat_template_timeout_s,
            max_chars=8 * config.max_body_bytes,
            executor=executor,
        )

    async def completion_ids(self, prompt: CompletionPrompt) -> list[int]:
        """Token ids of a /v1/completions prompt; BOS is added to text only if the model asks."""
        one = _single_prompt(prompt)
        if isinstance(one, str):
            if not one:
                raise bad_request("prompt must not be empty", param="prompt")
            t0 = time.perf_counter()
            bos = self.config.model.bos_token_id if self.config.model.add_bos_token else None
            ids = await self._encode(one, bos)
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

    async def chat_ids(self, messages: list[ChatMessage]) -> list[int]:
        """Token ids of the rendered conversation; the template already holds special tokens."""
        if not messages:
            raise bad_request("messages must not be empty", param="messages")
        t0 = time.perf_counter()
        text = await self.chat_template.render([_message_dict(m) for m in messages])
        ids = await self._encode(text, None)
        metrics.observer.tokenized(time.perf_counter() - t0)
        return ids

    async def _encode(self, text: str, bos: int | None) -> list[int]:
        loop = asyncio.get_running_loop()
        encoding = await loop.run_in_executor(
            self._executor, self.tokenizer.encode, text, None, False, False
        )
        ids = encoding.ids
        return [bos, *ids] if bos is not None else ids


def _single_prompt(prompt: CompletionPrompt) -> str | list[int]:
    """The one prompt a request carries; a batch of several is refused."""
    if isinstance(prompt, str):
        return prompt
    if all(isinstance(x, int) for x in prompt):
        return prompt  # type: ignore[return-value]
    if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return prompt[0]
    if any(isinstance(x, int) for x in prompt):
        raise bad_request("prompt mixes token ids with strings or lists", param="prompt")
    raise bad_request(
        f"prompt holds {len(prompt)} prompts; this server takes one prompt per request",
        param="prompt",
    )


def _message_dict(message: ChatMessage) -> dict[str, Any]:
    content = message.content
    if content is None:
        content = ""
    elif not isinstance(content, str):
        content = "\n".join(part.text for part in content)
    out: dict[str, Any] = {"role": message.role, "content": content}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out
