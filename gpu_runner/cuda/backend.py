"""The cuda device: the cpu runner's step on a GPU, asynchronously.

A launch queues the whole step on the current stream and returns: upload of the static table,
the model (a CUDA graph replay for decode-only batches), sampling, then on a side stream the
copy of the sampled ids into pinned host memory, closed by an event. Nothing in a launch waits
for the device; collect() waits for that event only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from gapless.common.config import EngineConfig
from gapless.common.messages import PromptLogprobs, StepPlan, StepResult, StepTiming
from gapless.gpu_runner.attention import StepLayout
from gapless.gpu_runner.batch import SLOT_MAPPING
from gapless.gpu_runner.cuda.flashinfer_attention import FlashinferAttention, import_flashinfer
from gapless.gpu_runner.cuda.startup import first_blocks, sizes_by_kv, start
from gapless.gpu_runner.runner import ModelRunner, step_result
from gapless.gpu_runner.sampling.sampler import SampleOutput

POLL_S = 0.0002  # a guess at the wait left when the ids are not on the host yet


@dataclass
class Launched:
    seq: int
    received: float  # perf_counter
    launched: float
    prepare_s: float
    host: SampleOutput | None  # pinned host tensors, valid once `done` has passed; None: empty
    device: SampleOutput | None  # kept alive until the copies from it are done
    num_logprobs: np.ndarray  # [B_s] int64
    start: torch.cuda.Event
    forwarded: torch.cuda.Event
    end: torch.cuda.Event
    done: torch.cuda.Event  # on the copy stream: the host tensors are filled
    # why computed at launch: only requests that ask for prompt logprobs pay the sync it costs
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)


def _timed() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


class CudaBackend(ModelRunner):
    def __init__(self, config: EngineConfig) -> None:
        import_flashinfer()  # fail before loading weights when the extra is missing
        since = time.perf_counter()
        free_at_start = torch.cuda.mem_get_info()[0]  # bytes, this process's context made
        super().__init__(config, device="cuda")
        self.copy_stream = torch.cuda.Stream()
        self._set_clock()
        # kernels built, largest step run, KV cache sized, graphs captured (gpu_runner/cuda/startup.py)
        self.ready_info = start(self, since, free_at_start)
        self._set_clock()

    def first_kv_blocks(self) -> int:
        return first_blocks(self) if sizes_by_kv(self) else super().first_kv_blocks()

    def _set_clock(self) -> None:
        # clock: one event and perf_counter taken together map device times to the host clock
        torch.cuda.synchronize()
        self._epoch = _timed()
        self._epoch.record()
        self._epoch.synchronize()
        self._epoch_host = time.perf_counter()

    def make_attention(self) -> FlashinferAttention:
        return FlashinferAttention(
            self.arch, self.config.block_size, self.max_blocks_per_seq, self.dtype, self.device
        )

    @torch.inference_mode()
    def capture(self) -> None:
        metas = {
            size: self.attn.add_graph_size(size, self.batch.column(SLOT_MAPPING, size))
            for size in self.graphs.sizes
        }

        def prime(size: int) -> None:  # every row a dummy: token 0 at position 0 into block 0
            self.batch.table[:size].zero_()
            ones = np.ones(size, dtype=np.int64)
            pages = np.zeros((size, 1), dtype=np.int64)
            layout = StepLayout(ones, ones, pages, self.batch.block_size)
            meta = self.attn.build(layout, self.batch.column(SLOT_MAPPING, size))
            assert meta is metas[size], "a decode of a capture size plans the graph's wrapper"

        self.graphs.capture(metas, prime)

    def host_time(self, event: torch.cuda.Event) -> float:
        return self._epoch_host + self._epoch.elapsed_time(event) / 1e3

    # ------------------------------------------------------------------ the Backend contract

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> Launched:
        received = time.perf_counter()
        self.begin(plan)
        events = [_timed() for _ in range(3)]
        start, forwarded, end = events
        done = torch.cuda.Event()
        if not plan.slots:
            for e in (*events, done):
                e.record()
            empty = np.zeros(0, dtype=np.int64)
            return Launched(plan.seq, received, received, 0.0, None, None, empty, *events, done)
        inp, meta = self.prepare(plan)
        prepared = time.perf_counter()
        start.record()
        logits = self.run_model(inp, meta)
        forwarded.record()
        out = self.sample(inp, logits[: inp.num_sample])
        end.record()
        scored = self.score_prompt(inp, logits[inp.num_sample :])
        self.copy_stream.wait_event(end)
        with torch.cuda.stream(self.copy_stream):
            host = SampleOutput(
                _to_host(out.token_ids),
                _to_host(out.logprobs),
                _to_host(out.top_ids),
                _to_host(out.top_logprobs),
            )
            done.record()
        return Launched(
            seq=plan.seq,
            received=received,
            launched=time.perf_counter(),
            prepare_s=prepared - received,
            host=host,
            device=out,
            num_logprobs=self.num_logprobs[inp.sample_slots_host],
            start=start,
            forwarded=forwarded,
            end=end,
            done=done,
            prompt_logprobs=scored,
        )

    def seconds_until_ready(self, handle: Launched) -> float:
        return 0.0 if handle.done.query() else POLL_S

    def collect(self, handle: Launched) -> StepResult:
        handle.done.synchronize()
        if handle.host is None:
            result = StepResult(handle.seq, [])
        else:
            result = step_result(handle.seq, handle.host, handle.num_logprobs)
            result.prompt_logprobs = handle.prompt_logprobs
        handle.device = None
        result.timing = StepTiming(
            plan_received=handle.received,
            launched=handle.launched,
            device_start=self.host_time(handle.start),
            device_end=self.host_time(handle.end),
            published=time.perf_counter(),
            prepare_s=handle.prepare_s,
            forward_s=handle.start.elapsed_time(handle.forwarded) / 1e3,
            sample_s=handle.forwarded.elapsed_time(handle.end) / 1e3,
        )
        return result


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    """A pinned copy of t, queued on the current stream."""
    if t is None:
        return None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)
