"""POST /v1/completions."""

from __future__ import annotations

from gapless.common.config import EngineConfig
from gapless.common.messages import TextDelta
from gapless.frontend.api.generation import ChoiceResult
from gapless.frontend.api.openai_fields import COMPLETION_REFUSED
from gapless.frontend.api.params import check_logprobs
from gapless.frontend.api.prelude import Prelude, Route
from gapless.frontend.api.prompts import CompletionPrompt
from gapless.frontend.api.protocol import CompletionRequest
from gapless.frontend.api.replies import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    Usage,
    completion_logprobs,
)
from gapless.frontend.api.state import FrontendState
from gapless.frontend.engine.tenants import Caller
from gapless.frontend.http.asgi import HttpRequest, Responder, encoder

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class CompletionChunks:
    """`text_completion` stream chunks; text_offset runs on per choice. With echo, each
    choice opens with its prompt's text."""

    def __init__(
        self,
        response_id: str,
        created: int,
        model: str,
        n: int,
        logprobs: bool,
        echoed: list[str] | None = None,
        first_tokens: list[str] | None = None,
    ) -> None:
        self._head = (response_id, created, model)
        self._logprobs = logprobs
        self._offsets = [0] * n  # characters sent so far, per choice
        self._echoed = echoed  # per choice: the prompt text sent first
        self._first_tokens = first_tokens  # per choice: the prompt's first token, with logprobs
        # per choice: a text-only chunk's bytes around its text (ChatChunks._split says why)
        self._around: list[tuple[bytes, bytes] | None] = [None] * n

    def opening(self, index: int, first: TextDelta) -> bytes | None:
        if self._echoed is None:
            return None
        text = self._echoed[index]
        logprobs = None
        if self._logprobs and self._first_tokens is not None:
            items = first.prompt_logprobs or []
            logprobs = completion_logprobs(items, 0, self._first_tokens[index])
        self._offsets[index] = len(text)
        return encoder.encode(self._chunk([CompletionChoice(index, text, logprobs)]))

    def plain(self, index: int, delta: TextDelta) -> bytes | None:
        if self._logprobs or delta.finish_reason is not None:
            return None
        around = self._around[index] or self._split(index)
        return around[0] + encoder.encode(delta.text) + around[1]

    def delta(self, index: int, delta: TextDelta) -> bytes:
        if (chunk := self.plain(index, delta)) is not None:  # the usual chunk: text only
            return chunk
        logprobs = None
        if self._logprobs:
            logprobs = completion_logprobs(delta.logprobs or [], self._offsets[index])
        self._offsets[index] += len(delta.text)
        choice = CompletionChoice(index, delta.text, logprobs, delta.finish_reason)
        return encoder.encode(self._chunk([choice]))

    def usage(self, usage: Usage) -> bytes:
        return encoder.encode(self._chunk([], usage))

    def _split(self, index: int) -> tuple[bytes, bytes]:
        whole = encoder.encode(self._chunk([CompletionChoice(index, "")]))
        head, marker, tail = whole.rpartition(b'"text":""')
        assert marker, whole
        self._around[index] = around = (head + b'"text":', tail)
        return around

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> Completion:
        rid, created, model = self._head
        return Completion(id=rid, created=created, model=model, choices=choices, usage=usage)


def _budget(body: CompletionRequest) -> tuple[int | None, str]:
    return DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens, "max_tokens"


def _logprobs(body: CompletionRequest, config: EngineConfig) -> int | None:
    return check_logprobs(body.logprobs, "logprobs", config)


COMPLETIONS = Route(
    "completions", CompletionRequest, COMPLETION_REFUSED, "cmpl", _budget, _logprobs
)


async def handle_completions(
    state: FrontendState, req: HttpRequest, out: Responder, caller: Caller
) -> None:
    pre = await Prelude.read(state, req, out, caller, COMPLETIONS)
    body, logprobs = pre.body, pre.logprobs
    if body.echo and logprobs is not None:
        pre.sampling["prompt_logprobs"] = logprobs
    echoed: list[str] | None = None
    first_tokens: list[str] | None = None

    def choice_logprobs(i: int, c: ChoiceResult) -> CompletionLogprobs | None:
        if logprobs is None:
            return None
        if echoed is None or first_tokens is None:
            return completion_logprobs(c.logprobs, 0)
        items = (c.prompt_logprobs or []) + c.logprobs
        return completion_logprobs(items, 0, first_tokens[i])

    def build(choices: list[ChoiceResult], usage: Usage) -> Completion:
        out_choices = [
            CompletionChoice(
                index=i,
                text=c.text if echoed is None else echoed[i] + c.text,
                logprobs=choice_logprobs(i, c),
                finish_reason=c.finish_reason,
            )
            for i, c in enumerate(choices)
        ]
        return Completion(
            id=pre.response_id,
            created=pre.created,
            model=pre.model,
            choices=out_choices,
            usage=usage,
        )

    with pre.admit(len(body.prompt) if _is_batch(body.prompt) else 1) as ticket:
        prompts = await state.prompter.completion_prompts(body.prompt)
        prediction = await state.prompter.prediction_ids(body.prediction)
        params = [pre.params(prompt_ids, "prompt") for prompt_ids in prompts]
        pre.admit_tokens(ticket, [*prompts, prediction])
        job = pre.job(ticket, prompts, params)
        job.prediction = prediction
        if body.echo:
            echoed, first_tokens = _echoed(body.prompt, prompts, pre.n, state)
        fmt = CompletionChunks(
            pre.response_id,
            pre.created,
            pre.model,
            len(job.params),
            logprobs is not None,
            echoed,
            first_tokens,
        )
        await pre.respond(job, fmt, build)


def _is_batch(prompt: CompletionPrompt) -> bool:
    """A list of prompts (strings or token-id lists), not one prompt of token ids."""
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)


def _echoed(
    prompt: CompletionPrompt, ids: list[list[int]], n: int, state: FrontendState
) -> tuple[list[str], list[str]]:
    """Per choice (n per prompt): its prompt's text as echoed (text prompts as given, token
    ids decoded), and its prompt's first token."""
    given = prompt if _is_batch(prompt) else [prompt]
    decode = state.prompter.decode
    texts = [p if isinstance(p, str) else decode(i) for p, i in zip(given, ids, strict=True)]
    firsts = [decode(p[:1]) for p in ids]
    return [t for t in texts for _ in range(n)], [f for f in firsts for _ in range(n)]
