"""The cuda device: the step executor on a GPU, asynchronously.

What cuda gives the executor: flashinfer's paged attention (cuda/flashinfer_attention.py), the
step's table through pinned staging (cuda/staging.py), CUDA graphs of every decode size, CUDA
events as its timeline and a side stream that copies the sampled ids to the host
(cuda/timeline.py). A launch queues the whole step on the current stream and returns; collect()
waits for the copy's event only. Before it is ready the backend runs the startup stages
(cuda/startup.py): kernels built, the largest step run, the KV cache sized, the graphs captured.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from gapless.common.config import EngineConfig
from gapless.common.messages import StepPlan, StepResult
from gapless.common.model_files import load_arch
from gapless.gpu_runner.attention import StepLayout
from gapless.gpu_runner.batch import SLOT_MAPPING, PersistentBatch, batch_for
from gapless.gpu_runner.cuda.flashinfer_attention import FlashinferAttention, import_flashinfer
from gapless.gpu_runner.cuda.staging import PinnedTables
from gapless.gpu_runner.cuda.startup import first_blocks, start
from gapless.gpu_runner.cuda.timeline import EventTimeline, PinnedResults
from gapless.gpu_runner.device import DeviceParts
from gapless.gpu_runner.executor import Launched, StepExecutor
from gapless.gpu_runner.kv_cache import blocks_in
from gapless.gpu_runner.model.load import DTYPES, load_model
from gapless.gpu_runner.model.shard import local_arch
from gapless.gpu_runner.sampling.sampler import SamplingPaths
from gapless.gpu_runner.tensor_parallel import TensorParallel

log = logging.getLogger("gapless.gpu_runner")
CUDA_SAMPLING = SamplingPaths(pinned_uploads=True)


class CudaBackend:
    def __init__(self, config: EngineConfig, tp: TensorParallel | None = None) -> None:
        """tp: this rank of a tensor-parallel group, on its own GPU (the current device)."""
        import_flashinfer()  # fail before loading weights when the extra is missing
        since = time.perf_counter()
        free_at_start = torch.cuda.mem_get_info()[0]  # bytes, this process's context made
        assert config.quantization in ("auto", "none"), "--quantization runs on the cpu device"
        self.config = config
        self.use_graphs = config.cuda_graph
        device = torch.device("cuda")
        self.dtype = DTYPES["bfloat16" if config.dtype == "auto" else config.dtype]
        full = load_arch(config.model)
        self.arch = full if tp is None else local_arch(full, tp.rank, tp.size)
        self.model = load_model(config.model, full, device, self.dtype, tp).eval()
        log.info("%s: %s activations, none weights", config.served_model_name,
                 str(self.dtype).removeprefix("torch."))  # fmt: skip
        memory = config.kv_cache_memory  # None: sized at start from measured memory
        if memory is None:
            num_blocks = first_blocks(config)
        else:
            num_blocks = blocks_in(memory // config.tensor_parallel_size, self.arch, config,
                                   self.dtype)  # fmt: skip
            if tp is not None:  # the core sees one pool: what every rank can hold
                num_blocks = tp.min(num_blocks, device)
        assert num_blocks >= 2, "--kv-cache-memory holds less than one KV block"
        # why num_blocks here: where the cache is sized from memory, the warm-up's; the tables
        # take the final size with the cache (cuda/startup.py)
        batch = batch_for(config, device, num_blocks, PinnedTables)
        bs = config.block_size
        self.attn = FlashinferAttention(self.arch, bs, batch.max_blocks_per_seq, self.dtype, device)
        self.timeline = EventTimeline()
        parts = DeviceParts(device, batch, self.attn, self.timeline, PinnedResults(),
                            CUDA_SAMPLING, pad=self.use_graphs)  # fmt: skip
        self.executor = StepExecutor(config, self.arch, self.model, self.dtype, num_blocks, parts)
        self.graphs = self.executor.graphs
        # kernels built, largest step run, KV cache sized, graphs captured (cuda/startup.py)
        self.ready_info = start(self.executor, self.capture, since, free_at_start)
        self.timeline.set_clock()

    @property
    def num_blocks(self) -> int:
        return self.executor.num_blocks

    @property
    def batch(self) -> PersistentBatch:
        return self.executor.batch

    @torch.inference_mode()
    def capture(self) -> None:
        """A CUDA graph of every decode size, each over the attention metadata it replays."""
        batch = self.executor.batch
        metas = {
            size: self.attn.add_graph_size(size, batch.column(SLOT_MAPPING, size))
            for size in self.graphs.sizes
        }

        def prime(size: int) -> None:  # every row a dummy: token 0 at position 0 into block 0
            batch.table[:size].zero_()
            ones = np.ones(size, dtype=np.int64)
            layout = StepLayout(ones, ones, np.zeros((size, 1), dtype=np.int64), batch.block_size)
            meta = self.attn.build(layout, batch.column(SLOT_MAPPING, size))
            assert meta is metas[size], "a decode of a capture size plans the graph's wrapper"

        self.graphs.capture(metas, prime)

    # ------------------------------------------------------------------ the Backend contract

    def launch(self, plan: StepPlan) -> Launched:
        return self.executor.launch(plan)

    def seconds_until_ready(self, handle: Launched) -> float:
        return self.executor.seconds_until_ready(handle)

    def collect(self, handle: Launched) -> StepResult:
        return self.executor.collect(handle)
