"""Scheduler and runner wired together in one process, `depth` steps in flight, as the core
loop does it over ZMQ. For tests that need the engine's token logic without processes."""

from __future__ import annotations

import time
from collections import deque

import msgspec

from gapless.core.common.config import EngineConfig
from gapless.core.common.messages import AddRequest, SamplingParams
from gapless.core.common.model_files import resolve_model
from gapless.core.scheduler import Scheduler
from gapless.gpu_runner.runner import ModelRunner


def make_config(model_dir, **overrides) -> EngineConfig:
    base = EngineConfig(
        model=resolve_model(str(model_dir)), served_model_name="tiny", dtype="float32", threads=1
    )
    return msgspec.structs.replace(base, **overrides)


class Harness:
    def __init__(self, config: EngineConfig, depth: int) -> None:
        self.runner = ModelRunner(config)
        self.depth = depth
        self.scheduler = Scheduler(
            num_blocks=self.runner.num_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.model.max_model_len,
            eos_token_ids=config.model.eos_token_ids,
        )
        self.outputs: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.steps = 0

    def add(self, rid: str, prompt: list[int], params: SamplingParams) -> None:
        self.scheduler.add_request(
            AddRequest(
                request_id=rid,
                frontend_id=0,
                prompt_token_ids=prompt,
                params=params,
                arrival_time=time.time(),
            )
        )
        self.outputs[rid] = []

    def run(self, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]] | None = None):
        """Steps until every request ended; arrivals[k] join before step k is planned."""
        arrivals = dict(arrivals or {})
        inflight: deque = deque()
        while arrivals or inflight or self.scheduler.has_work:
            for rid, prompt, params in arrivals.pop(self.steps, []):
                self.add(rid, prompt, params)
            while len(inflight) < self.depth and (step := self.scheduler.schedule()):
                # the runner executes plans in order as they arrive, as the process does
                inflight.append((step, self.runner.execute(step.plan)))
            if inflight:
                step, result = inflight.popleft()
                out = self.scheduler.update_from_output(step, result)
                for req, tok, reason in zip(
                    out.requests, out.token_ids, out.finish_reasons, strict=True
                ):
                    self.outputs[req.request_id].append(tok)
                    if reason:
                        self.finish[req.request_id] = reason
            self.steps += 1
            assert self.steps < 10_000, "engine made no progress"
        return self.outputs
