"""A test double for the engine behind the frontend: the real EngineClient bookkeeping, with a
`send` that answers AddRequests itself instead of going to the core over ZMQ.

It echoes the prompt's words back, one word per delta (one token each), stopping with "length"
at max_tokens or "stop" when the words run out.
"""

from __future__ import annotations

import asyncio

import tokenizers

from gapless.core.common.messages import (
    Abort,
    AddRequest,
    CoreInput,
    EngineDead,
    TextDelta,
    TextDeltas,
    TokenLogprob,
    TopLogprob,
)
from gapless.frontend.engine_client import EngineClient


class FakeEngine(EngineClient):
    def __init__(self, tokenizer: tokenizers.Tokenizer, frontend_id: int = 0) -> None:
        super().__init__(frontend_id, self._receive)
        self.tokenizer = tokenizer
        self.added: list[AddRequest] = []
        self.aborted: list[str] = []
        self.delay_s = 0.0  # between deltas
        self.finish_with: str | None = None  # "error" or "abort": delta number fail_at ends so
        self.fail_at = 0
        self.gate: asyncio.Event | None = None  # when set: deltas wait for it after the first
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def _receive(self, msg: CoreInput) -> None:
        match msg:
            case AddRequest(request_id=rid):
                self.added.append(msg)
                task = asyncio.get_running_loop().create_task(self._answer(msg))
                self._tasks[rid] = task
                task.add_done_callback(lambda _, rid=rid: self._tasks.pop(rid, None))
            case Abort(request_ids=ids):
                self.aborted.extend(ids)
                for rid in ids:
                    task = self._tasks.pop(rid, None)
                    if task is not None:
                        task.cancel()

    @property
    def num_in_flight(self) -> int:
        """Requests whose deltas still have a queue in the client's bookkeeping."""
        return len(self._queues)

    def die(self, reason: str = "core crashed") -> None:
        self.dispatch(EngineDead(reason))

    async def _answer(self, req: AddRequest) -> None:
        words = self.tokenizer.decode(req.prompt_token_ids, skip_special_tokens=True).split()
        words = words or ["empty"]
        params = req.params
        num_prompt = len(req.prompt_token_ids)
        for i in range(params.max_tokens):
            await asyncio.sleep(self.delay_s)
            if i == 1 and self.gate is not None:
                await self.gate.wait()
            finish = None
            if self.finish_with is not None and i == self.fail_at:
                finish = self.finish_with
            elif i + 1 == params.max_tokens:
                finish = "length"
            elif i + 1 == len(words):
                finish = "stop"
            word = words[i % len(words)]
            text = word if i == 0 else " " + word
            token_id = 100 + i
            logprobs = None
            if params.logprobs is not None:
                top = [TopLogprob(f"{text}#{k}", -1.0 - k, 200 + k) for k in range(params.logprobs)]
                logprobs = [TokenLogprob(text, -0.5, token_id, top)]
            error = "fake failure" if finish == "error" else None
            delta = TextDelta(
                req.request_id, text, [token_id], num_prompt, i + 1, finish, logprobs, error
            )
            self.dispatch(TextDeltas([delta]))
            if finish is not None:
                return
