"""A test double for the engine behind the frontend: the real EngineClient bookkeeping, with a
`send` that answers AddRequests itself instead of going to the core over ZMQ.

It echoes the prompt's words back, one word per delta (one token each), stopping with "length"
at max_tokens or "stop" when the words run out. With `hold` set, requests stay queued (no delta)
until it is set; `queue_state` and `time_out` send what the core would.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import numpy as np
import tokenizers

from gapless.common.messages import (
    Abort,
    AddRequest,
    CoreInput,
    EngineDead,
    LoadLora,
    LoraAdapters,
    QueueState,
    SamplingParams,
    TextDelta,
    TextDeltas,
    TokenLogprob,
    TopLogprob,
    UnloadLora,
)
from gapless.frontend.api.stream import Job, RequestStream
from gapless.frontend.engine.client import EngineClient
from gapless.frontend.engine.queue_view import Ticket

Direct = Callable[[int, TextDelta, float], bool]


class _WrittenBy(RequestStream):
    """A stream whose listener writes are `direct(index, delta, received)`'s: True if it
    took the delta (it is not handed to the handler)."""

    def __init__(self, client: EngineClient, job: Job, direct: Direct) -> None:
        super().__init__(client, job)
        self._direct_on = True
        self._written_by = direct

    def write_now(self, index: int, delta: TextDelta, received: float) -> bool:
        return self._written_by(index, delta, received)


def request_stream(
    client: EngineClient,
    request_id: str,
    prompt: list[int],
    params: list[SamplingParams],
    *,
    tenant: str = "",
    priority: int = 0,
    ticket: Ticket | None = None,
    label: str = "",
    direct: Direct | None = None,
) -> RequestStream:
    """One request of len(params) choices of `prompt`, as a handler opens it (without a
    ticket, one is taken here); with `direct`, the listener's writes go to it."""
    if ticket is None:
        ticket = client.queue.take(tenant, len(params))
        ticket.set_prompt(len(prompt))
    prompts = [prompt] * len(params)
    job = Job("completions", request_id, prompts, params, tenant, priority, time.time(), ticket,
              label=label)  # fmt: skip
    return RequestStream(client, job) if direct is None else _WrittenBy(client, job, direct)


def fake_embedding(prompt_ids: list[int]) -> bytes:
    """A pooling request's stand-in vector: [8] little-endian float32 from its token ids."""
    vec = np.zeros(8, dtype="<f4")
    for i, t in enumerate(prompt_ids):
        vec[i % 8] += t % 97 + 1
    return vec.tobytes()


class FakeEngine(EngineClient):
    def __init__(self, tokenizer: tokenizers.Tokenizer, frontend_id: int = 0) -> None:
        super().__init__(frontend_id, self._receive)
        self.tokenizer = tokenizer
        self.added: list[AddRequest] = []
        self.aborted: list[str] = []
        self.delay_s = 0.0  # between deltas
        self.cached_tokens = 0  # prompt tokens the last delta says the prefix cache held
        self.finish_with: str | None = None  # "error" or "abort": delta number fail_at ends so
        self.fail_at = 0
        self.gate: asyncio.Event | None = None  # when set: deltas wait for it after the first
        # when set: requests that `held` picks stay queued, sending nothing until it is set
        self.hold: asyncio.Event | None = None
        self.held: Callable[[str], bool] = lambda request_id: True
        self.script: list[str] | None = None  # when set: the deltas' texts, then "stop"
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.lora_error = ""  # when set: a LoadLora is refused with it, as a core's bad adapter
        self.lora_loads: list[LoadLora] = []

    def _receive(self, msg: CoreInput) -> None:
        match msg:
            case AddRequest(request_id=rid):
                self.added.append(msg)
                task = asyncio.get_running_loop().create_task(self._answer(msg))
                self._tasks[rid] = task
                task.add_done_callback(lambda _, rid=rid: self._tasks.pop(rid, None))
            case LoadLora(token=token, name=name):  # as the core answers, the set to all
                self.lora_loads.append(msg)
                names = list(self.lora_names or [])
                if self.lora_error:
                    self.dispatch(LoraAdapters(names, token, self.lora_error, 400))
                else:
                    self.dispatch(LoraAdapters([*names, name], token))
            case UnloadLora(token=token, name=name):
                names = list(self.lora_names or [])
                if name not in names:
                    self.dispatch(LoraAdapters(names, token, f"lora_name: no {name!r}", 404))
                else:
                    self.dispatch(LoraAdapters([n for n in names if n != name], token))
            case Abort(request_ids=ids):
                self.aborted.extend(ids)
                for rid in ids:
                    task = self._tasks.pop(rid, None)
                    if task is not None:
                        task.cancel()

    def core_silent_s(self) -> float:
        """A fake core is always heard from: /health answers by what a test does, not by how
        long the test took (tests/frontend/test_process_faults.py lets a real one fall silent)."""
        return 0.0

    @property
    def num_in_flight(self) -> int:
        """Requests whose deltas still have a queue in the client's bookkeeping."""
        return len(self._queues)

    def die(self, reason: str = "core crashed") -> None:
        self.dispatch(EngineDead(reason))

    def queue_state(
        self,
        waiting: list[int],
        tokens: list[int] | None = None,
        tenants: list[dict[str, int]] | None = None,
        drain_per_s: float = 0.0,
    ) -> None:
        """The core's QueueState, lists indexed by frontend id."""
        tokens = tokens or [0] * len(waiting)
        tenants = tenants or [{} for _ in waiting]
        self.dispatch(QueueState(waiting, tokens, tenants, drain_per_s))

    def time_out(self, request_id: str, waited_s: float = 2.0, limit_s: float = 1.0) -> None:
        """End a queued request as the core does past --max-queue-wait."""
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()
        why = f"waited {waited_s:.1f} s for a seat, longer than --max-queue-wait {limit_s:g} s"
        delta = TextDelta(request_id, "", [], 1, 0, "error", None, why, "queue_timeout")
        self.dispatch(TextDeltas([delta]))

    async def _answer(self, req: AddRequest) -> None:
        if self.script is not None:
            for i, text in enumerate(self.script):
                finish = "stop" if i + 1 == len(self.script) else None
                delta = TextDelta(req.request_id, text, [100 + i], 1, i + 1, finish)
                self.dispatch(TextDeltas([delta]))
            return
        words = self.tokenizer.decode(req.prompt_token_ids, skip_special_tokens=True).split()
        words = words or ["empty"]
        params = req.params
        num_prompt = len(req.prompt_token_ids)
        if self.hold is not None and self.held(req.request_id):
            await self.hold.wait()
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
            if finish is not None:
                delta.num_cached_tokens = self.cached_tokens
                if params.pooling is not None:
                    delta.embedding = fake_embedding(req.prompt_token_ids)
            if i == 0 and params.prompt_logprobs is not None:  # each prompt token scores -0.25
                delta.prompt_logprobs = [
                    TokenLogprob(self.tokenizer.decode([t]), -0.25, t, [])
                    for t in req.prompt_token_ids[1:]
                ]
            self.dispatch(TextDeltas([delta]))
            if finish is not None:
                return
