"""The real EngineCore in one process: plans go to an in-process backend (the cpu runner's model,
the sim device, cuda) in order and results come back in order, as the processes do over ZMQ;
the TokenBatches go through a real DetokenizerState. No sockets."""

from __future__ import annotations

import time
from collections import deque

import msgspec

from gapless.common.config import EngineConfig
from gapless.common.messages import (
    Abort,
    AddRequest,
    DetokNew,
    SamplingParams,
    StreamEnded,
    TextDelta,
    TokenBatch,
)
from gapless.common.model_files import load_tokenizer, resolve_model
from gapless.core.engine import EngineCore
from gapless.core.metrics import CoreMetrics
from gapless.core.scheduler import Scheduler
from gapless.detokenizer.state import DetokenizerState, Outbox
from gapless.gpu_runner.backend import Backend, make_backend


def make_config(model_dir, **overrides) -> EngineConfig:
    """fp32, one thread, eager (tests/gpu_runner/test_compiled.py covers the compiled step)."""
    base = EngineConfig(
        model=resolve_model(str(model_dir)),
        served_model_name="tiny",
        dtype="float32",
        threads=1,
        compile=False,
    )
    return msgspec.structs.replace(base, **overrides)


# arrivals[k]: (request id, prompt ids, params[, tenant[, priority[, prediction[, lora]]]]) that
# join before step k
Arrivals = dict[int, list[tuple]]


class Harness:
    def __init__(
        self,
        config: EngineConfig,
        backend: Backend | None = None,
        metrics: CoreMetrics | None = None,
    ) -> None:
        self.backend = backend or make_backend(config)
        costs = getattr(self.backend, "step_costs", None)  # as RunnerReady brings them
        self.core = EngineCore(config, self.backend.num_blocks, metrics, step_costs=costs)
        self.detok = DetokenizerState(load_tokenizer(config.model))
        self.outputs: dict[str, list[int]] = {}  # token ids as the core sent them
        self.token_steps: dict[str, list[int]] = {}  # the step each of those ids arrived at
        self.arrived: dict[str, int] = {}  # the step each request joined before
        self.backlogged: list[set[str]] = []  # per step: tenants with requests waiting
        self.frontend: list = []  # what the core sent frontends (queue states, replies)
        self.kv_events: list = []  # what the core would publish to routers, each step's a list
        self.finish: dict[str, str] = {}  # the core's end reason
        self.deltas: dict[str, list[TextDelta]] = {}  # what the frontend would receive
        self.steps = 0
        self.max_inflight = 0
        self.reader = None  # reads adapters at run time, as the runner process does
        if config.enable_lora:
            from gapless.common.model_files import load_arch
            from gapless.gpu_runner.lora.reader import AdapterReader

            stack = getattr(getattr(self.backend, "executor", None), "lora", None)
            self.reader = AdapterReader(load_arch(config.model), config.max_lora_rank, stack)

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    def add(
        self,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        tenant="",
        priority=0,
        prediction: list[int] | None = None,
        lora: str = "",
    ) -> None:
        self.outputs[rid] = []
        self.token_steps[rid] = []
        self.deltas[rid] = []
        self.arrived[rid] = self.steps
        self.core.handle(
            AddRequest(
                request_id=rid,
                frontend_id=0,
                prompt_token_ids=prompt,
                params=params,
                arrival_time=time.time(),
                tenant=tenant,
                priority=priority,
                prediction=prediction or [],
                lora=lora,
            )
        )

    def run(
        self,
        arrivals: Arrivals | None = None,
        aborts: dict[int, list[str]] | None = None,
        messages: dict[int, list] | None = None,
    ):
        """Steps until every request ended; aborts[k] and messages[k] (CoreInputs) are sent
        before step k."""
        arrivals, aborts = dict(arrivals or {}), dict(aborts or {})
        messages = dict(messages or {})
        inflight: deque = deque()
        result = None
        while (arrivals or aborts or messages or inflight or self.core.has_work
               or result is not None or self.reading):  # fmt: skip
            for msg in messages.pop(self.steps, []):
                self.core.handle(msg)
            for arrival in arrivals.pop(self.steps, []):
                self.add(*arrival)
            if self.steps in aborts:
                self.core.handle(Abort(aborts.pop(self.steps)))
            self.take_reads(wait=not inflight and not self.core.has_work)
            out = self.core.step(result)
            self.backlogged.append({r.tenant for r in self.scheduler.waiting})
            for msg in out.runner:
                assert self.reader is not None
                self.reader.handle(msg)
            for plan in out.plans:  # launched in order as they come, as the runner process does
                inflight.append(self.backend.launch(plan))
            self.max_inflight = max(self.max_inflight, len(inflight))
            for msg in out.detok:
                self._detokenize(msg)
            self.frontend += [msg for _, msg in out.frontend]
            if out.kv_events:
                self.kv_events.append(out.kv_events)
            result = self.backend.collect(inflight.popleft()) if inflight else None
            self.steps += 1
            assert self.steps < 10_000, "engine made no progress"
        return self.outputs

    @property
    def reading(self) -> bool:
        """An adapter is being read, or requests wait for theirs to be."""
        lora = self.scheduler.lora
        return self.reader is not None and (self.reader.busy or bool(lora and lora.held))

    def take_reads(self, wait: bool) -> None:
        """Hand the core the adapters read since; with wait, wait for one first (nothing
        else can move)."""
        if self.reader is None:
            return
        if wait and self.reader.busy:
            self.reader.wait(timeout_s=30.0)
        for answer in self.reader.finished():
            self.core.adapter_read(answer)

    def _detokenize(self, msg) -> None:
        if isinstance(msg, DetokNew):
            self.detok.add(msg)
            return
        assert isinstance(msg, TokenBatch)
        pos = 0
        for rid, n, reason in zip(msg.request_ids, msg.counts, msg.finish_reasons, strict=True):
            self.outputs[rid] += msg.token_ids[pos : pos + n]
            self.token_steps[rid] += [self.steps] * n
            pos += n
            if reason:
                assert rid not in self.finish, f"{rid} ended twice"
                self.finish[rid] = reason
        box = Outbox()
        self.detok.process(msg, box)
        for deltas in box.deltas.values():
            for d in deltas:
                self.deltas[d.request_id].append(d)
        if box.stop_hits:  # the detokenizer process sends this back to the core
            for rid in box.stop_hits:
                self.finish[rid] = "stop_string"
            self.core.handle(StreamEnded(box.stop_hits, "stop"))


class Recorder(Harness):
    """The harness, keeping each token's logprob and each request's cached prompt tokens."""

    def __init__(self, config, backend=None) -> None:
        super().__init__(config, backend)
        self.logprobs: dict[str, list[float]] = {}
        self.cached: dict[str, int] = {}

    def _detokenize(self, msg) -> None:
        if isinstance(msg, TokenBatch):
            pos = 0
            for rid, n in zip(msg.request_ids, msg.counts, strict=True):
                got = msg.logprobs[pos : pos + n] if msg.logprobs else []
                self.logprobs.setdefault(rid, []).extend(lp.logprob for lp in got)
                pos += n
            if msg.num_cached_tokens:  # sent with a request's last tokens
                self.cached.update(zip(msg.request_ids, msg.num_cached_tokens, strict=True))
        super()._detokenize(msg)
