"""The cpu device: the step executor over torch's cpu kernels, run on the host.

What the cpu gives the executor: its torch threads (--threads, one for a one-row step while
other programs keep the cores busy), the formats --dtype and --quantization resolve to on this
CPU (quantized layers: gpu_runner/cpu/quant.py), the torch path's paged attention with the C++
decode kernel where it builds (gpu_runner/cpu/kernels.py), padded decode batches through the
compiled layers (gpu_runner/cpu/compiled.py), the wall clock as its timeline, and sampled ids
that are on the host at once. A launch runs the whole step, so it is ready when it returns.
"""

from __future__ import annotations

import logging

import torch

from gapless.common.config import CPU_KV_CACHE_MEMORY, EngineConfig
from gapless.common.messages import StepPlan, StepResult
from gapless.common.model_files import ModelArch, load_arch
from gapless.common.step_costs import table_sizes
from gapless.gpu_runner.batch import PersistentBatch, batch_for
from gapless.gpu_runner.cpu import compiled, kernels
from gapless.gpu_runner.cpu.attention import TorchAttention
from gapless.gpu_runner.cpu.calibrate import CALIBRATE_MAX_TOKENS, step_seconds
from gapless.gpu_runner.cpu.formats import resolve_dtype, resolve_quantization
from gapless.gpu_runner.cpu.quant import SMALL_ROWS, quantize_model
from gapless.gpu_runner.cpu.sampling import CPU_SAMPLING
from gapless.gpu_runner.cpu.threads import ThreadSizer
from gapless.gpu_runner.device import DeviceParts, HostClock, HostResults
from gapless.gpu_runner.draft_model import DraftModel
from gapless.gpu_runner.executor import Launched, StepExecutor
from gapless.gpu_runner.graph import capture_sizes
from gapless.gpu_runner.kv_cache import blocks_in, make_kv_cache
from gapless.gpu_runner.lora.adapter import load_adapter
from gapless.gpu_runner.lora.stack import LoraStack
from gapless.gpu_runner.model import CausalLM
from gapless.gpu_runner.model.load import DTYPES, load_model
from gapless.gpu_runner.model.shard import local_arch
from gapless.gpu_runner.tensor_parallel import TensorParallel

log = logging.getLogger("gapless.gpu_runner")
CPU = torch.device("cpu")


def num_kv_blocks(arch: ModelArch, config: EngineConfig, dtype: torch.dtype) -> int:
    """Blocks that fit in --kv-cache-memory (its cpu default when not given), shared by the
    tensor-parallel ranks: each holds its K/V heads' share of every block."""
    memory = CPU_KV_CACHE_MEMORY if config.kv_cache_memory is None else config.kv_cache_memory
    return blocks_in(memory // config.tensor_parallel_size, arch, config, dtype)


class CpuBackend:
    def __init__(
        self,
        config: EngineConfig,
        use_graphs: bool | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        """use_graphs (default config.cuda_graph): run decode-only batches padded through the
        graph layer (compiled with --compile); False runs every step eagerly at its own size.
        tp: this rank of a tensor-parallel group; the step is then eager (the compiled layers
        hold no collectives). --threads is shared among the runners of this host (ranks and
        replicas)."""
        self.config = config
        self.tp = tp
        self.use_graphs = config.cuda_graph if use_graphs is None else use_graphs
        # runners on this host: the ranks of each --data-parallel-size replica
        ranks_here = config.tensor_parallel_size // config.nnodes * config.data_parallel_size
        threads = max(1, config.threads // ranks_here)
        torch.set_num_threads(threads)
        self.dtype = DTYPES[resolve_dtype(config.dtype, "cpu")]
        self.full_arch = load_arch(config.model)
        self.arch = self.full_arch if tp is None else local_arch(self.full_arch, tp.rank, tp.size)
        self.quantization = "none"
        if tp is None:
            self.quantization = resolve_quantization(
                config.quantization, config.dtype, "cpu", config.model.path
            )
        self.model = self._load_model()
        num_blocks = num_kv_blocks(self.arch, config, self.dtype)
        if tp is not None:  # the core sees one pool: what every rank can hold
            num_blocks = tp.min(num_blocks, CPU)
        assert num_blocks >= 2, "--kv-cache-memory holds less than one KV block"
        self.compiled = config.compile and self.use_graphs and tp is None
        batch = batch_for(config, CPU, num_blocks)
        batch.expand_verify = True
        self.attn = self._attention(batch)
        parts = DeviceParts(
            device=CPU,
            batch=batch,
            attention=self.attn,
            timeline=HostClock(),
            results=HostResults(),
            sampling=CPU_SAMPLING,
            pad=self.use_graphs,
            run_layers=compiled.CompiledLayers() if self.compiled else None,
            before_forward=ThreadSizer(threads) if threads > 1 else None,
        )
        self.executor = StepExecutor(config, self.arch, self.model, self.dtype, num_blocks, parts)
        self.executor.lora = self._load_adapters()
        self.executor.draft = self._load_draft(batch)
        self.graphs = self.executor.graphs
        if self.compiled:
            self._compile()
        # speculation's cost model (core/spec_cost.py), for --speculative's drafts; why not
        # with ranks: every rank would have to run the same forwards at once
        self.step_costs: tuple[list[int], list[float]] = ([], [])
        if config.speculative != "off" and config.num_speculative_tokens and tp is None:
            sizes = table_sizes(min(config.max_num_batched_tokens, CALIBRATE_MAX_TOKENS))
            self.step_costs = step_seconds(self.executor, sizes)

    @property
    def num_blocks(self) -> int:
        return self.executor.num_blocks

    @property
    def batch(self) -> PersistentBatch:
        return self.executor.batch

    def _load_model(self) -> CausalLM:
        model = load_model(self.config.model, self.full_arch, CPU, self.dtype, self.tp)
        if self.quantization != "none":
            quantize_model(model, self.quantization, self.config.model.path, self.arch)
        log.info("%s: %s activations, %s weights", self.config.served_model_name,
                 str(self.dtype).removeprefix("torch."), self.quantization)  # fmt: skip
        return model.eval()

    def _load_adapters(self) -> LoraStack | None:
        """The adapter stack on the model, --lora-modules read into host memory, in float32
        whatever its dtype (docs/lora.md)."""
        config = self.config
        if not (config.enable_lora or config.lora_modules):
            return None
        assert self.tp is None, "LoRA adapters with tensor parallelism are not supported yet"
        stack = LoraStack(self.model, self.arch, config.max_loras, config.max_lora_rank,
                          config.max_num_seqs)  # fmt: skip
        for name, path in config.lora_modules.items():
            stack.keep(load_adapter(name, path, self.arch, config.max_lora_rank))
            log.info("LoRA adapter %s read", name)
        return stack

    def _load_draft(self, batch: PersistentBatch) -> DraftModel | None:
        """--speculative draft's model, in --dtype, with --quantization as it resolves for the
        draft's own file; its KV cache has the target's blocks (gpu_runner/draft_model.py)."""
        info = self.config.draft_model
        if self.config.speculative != "draft" or info is None:
            return None
        assert self.tp is None, "--speculative draft with tensor parallelism"
        arch = load_arch(info)
        model = load_model(info, arch, CPU, self.dtype)
        mode = resolve_quantization(self.config.quantization, self.config.dtype, "cpu", info.path)
        if mode != "none":
            quantize_model(model, mode, info.path, arch)
        log.info("draft model %s: %s layers, %s weights", info.path, arch.num_layers, mode)
        kv = make_kv_cache(arch, self.num_blocks, batch.block_size, self.dtype, CPU)
        return DraftModel(model.eval(), kv, self._attention(batch, arch.scale), batch)

    def _attention(self, batch: PersistentBatch, scale: float | None = None) -> TorchAttention:
        bs = self.config.block_size
        max_context = batch.max_blocks_per_seq * bs
        kernel = self.config.attention_kernel and kernels.available(self.dtype)
        if scale is None:
            log.info(
                "cpu decode attention: %s", "paged kernel" if kernel else "torch (gather + SDPA)"
            )
        max_decodes = capture_sizes(self.config.max_num_seqs)[-1]
        scale = self.arch.scale if scale is None else scale
        return TorchAttention(max_decodes, max_context, bs, scale, kernel)

    def _compile(self) -> None:
        """Compile the padded decode step at start; eager where it cannot be compiled."""
        sizes = [s for s in compiled.WARM_SIZES if s in self.graphs.sizes]
        if self.quantization == "int4-dual":  # why: past SMALL_ROWS is a third compilation
            sizes += [s for s in self.graphs.sizes if s > SMALL_ROWS][:1]
        try:
            compiled.warm_up(self.executor.prime_decode, sizes)
        except Exception as e:  # why: no C++ compiler (a slim image) must not stop serving
            compiled.log.warning(
                "cannot compile the cpu decode step, running it eagerly (--no-compile "
                "skips trying): %s: %s", type(e).__name__, str(e).splitlines()[0][:300],
            )  # fmt: skip
            self.compiled = False
            self.graphs.forward = self.executor.forward

    # ------------------------------------------------------------------ the Backend contract

    def launch(self, plan: StepPlan) -> Launched:
        return self.executor.launch(plan)

    def seconds_until_ready(self, handle: Launched) -> float:
        return 0.0

    def collect(self, handle: Launched) -> StepResult:
        return self.executor.collect(handle)
