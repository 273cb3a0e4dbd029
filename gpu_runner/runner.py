"""Executes step plans: model, paged KV cache, persistent batch, graph layer, sampler.

ModelRunner is the cpu device's backend; CudaBackend (gpu_runner/cuda/backend.py) builds on it and
changes only the attention backend, the graph capture and how results come back to the host.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from gapless.common.config import CPU_KV_CACHE_MEMORY, EngineConfig, max_useful_blocks
from gapless.common.messages import (
    PromptLogprobs,
    SampleLogprobs,
    StepPlan,
    StepResult,
    StepTiming,
)
from gapless.common.model_files import ModelArch, load_arch, load_tokenizer
from gapless.gpu_runner.attention import AttentionMeta, StepLayout, TorchAttention
from gapless.gpu_runner.batch import (
    FED_IDS,
    FED_POSITIONS,
    FED_SLOTS,
    IDS,
    LOGIT_ROWS,
    POSITIONS,
    SAMPLE_POSITIONS,
    SAMPLE_SLOTS,
    SLOT_MAPPING,
    TOK_SLOT,
    PersistentBatch,
    StepInputs,
)
from gapless.gpu_runner.cpu import compiled, kernels
from gapless.gpu_runner.cpu.quant import SMALL_ROWS, holds_q4_1, quantize_model
from gapless.gpu_runner.cpu.threads import BusyCores
from gapless.gpu_runner.graph import DecodeGraphs, capture_sizes
from gapless.gpu_runner.model import CausalLM
from gapless.gpu_runner.model.weights import load_weights
from gapless.gpu_runner.sampling.grammar import GrammarRows
from gapless.gpu_runner.sampling.logprobs import row_logprobs
from gapless.gpu_runner.sampling.sampler import SampleOutput, SamplerState

log = logging.getLogger("gapless.gpu_runner")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
BF16_CPU_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # /proc/cpuinfo: x86 flags, Arm features


def resolve_dtype(dtype: str, device: str) -> str:
    """--dtype auto: bfloat16 on cuda, and on a CPU that computes it natively, else float32.

    why: without bfloat16 instructions torch converts through float32 inside every matmul. On
    an AVX2-only AMD EPYC (2 cores) the default model's matmuls at batch 32 took 519 ms a step
    in bfloat16 against 119 ms in float32 (`python -m gapless.bench.floor --batch 32 --format
    bf16`, then `fp32`); on the AVX-512 BF16 cpu where the earlier cpu figures were taken,
    bfloat16 was the faster at batch 32 (bench/RESULTS.md, "CPU, the default model")."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device != "cpu" or BF16_CPU_FLAGS & cpu_flags() else "float32"


def resolve_quantization(
    quantization: str, dtype: str, device: str, model_path: str | None = None
) -> str:
    """--quantization auto, on a cpu where --dtype auto gives float32: w8a8 where torch has
    fbgemm's int8 kernels (x86), else int8; where it gives bfloat16: int4-dual for a Q4_1
    GGUF, whose weights int4 holds exactly; none elsewhere (an explicit --dtype float32 keeps
    float32 weights: the exact path).

    why: a float32 weight is 4 bytes read a token. On an AVX2-only AMD EPYC (2 cores), served,
    int8 decoded one stream at 26.5 ms a token against 52.3 (TPOT, `gapless bench --launch
    --workload 128:256 --num-requests 1 -- --quantization int8`, then `none`) and 32 streams
    of 128:128 at 110.0 against 102.7 output tok/s (`--num-requests 32`, 128:128); w8a8 then
    served the 32 streams at 121.9 against int8's 89.3 tok/s in one sitting, and one stream
    as int8 does (its single rows take int8's kernel); perplexity +0.40% (w8a8) and +0.53%
    (int8) (bench/RESULTS.md). Where bfloat16 is native, bfloat16 weights served a batch of
    32 1.5x faster than int8 or int4 (bench/RESULTS.md, "CPU, the default model"), and on an
    AVX-512 BF16 EPYC (2 cores) bfloat16 served 32 streams at 472.8 tok/s against int4's
    356.4, but one stream at 45.0 against 89.4 (`gapless bench --launch --workload 128:128
    --num-requests 32 -- --quantization Q`, then 128:256 and 1): int4-dual takes each."""
    if quantization != "auto":
        return quantization
    if device != "cpu" or dtype != "auto":
        return "none"
    if resolve_dtype("auto", device) == "float32":
        return "w8a8" if has_fbgemm() else "int8"
    return "int4-dual" if model_path and holds_q4_1(model_path) else "none"


def has_fbgemm() -> bool:
    """Whether this torch has fbgemm's int8 cpu kernels (x86 builds)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo; empty where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def kv_block_bytes(arch: ModelArch, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block of block_size tokens over every layer."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * elem


def num_kv_blocks(arch: ModelArch, config: EngineConfig, dtype: torch.dtype) -> int:
    """Blocks that fit in --kv-cache-memory (its cpu default when not given), and no more than
    max_num_seqs full contexts need."""
    memory = CPU_KV_CACHE_MEMORY if config.kv_cache_memory is None else config.kv_cache_memory
    fit = memory // kv_block_bytes(arch, config.block_size, dtype)
    cap = max_useful_blocks(config.max_num_seqs, config.model.max_model_len, config.block_size)
    return int(min(fit, cap))


def step_result(seq: int, out: SampleOutput, num_logprobs: np.ndarray) -> StepResult:
    """out holds host tensors; num_logprobs [B_s] is each sampled row's ask (-1: none)."""
    result = StepResult(seq=seq, token_ids=out.token_ids.tolist())
    if out.logprobs is not None:
        result.logprobs = row_logprobs(num_logprobs, out.logprobs, out.top_ids, out.top_logprobs)
    return result


class ModelRunner:
    def __init__(
        self, config: EngineConfig, device: str = "cpu", use_graphs: bool | None = None
    ) -> None:
        """use_graphs (default config.cuda_graph): run decode-only batches padded through the
        graph layer; False runs every step eagerly at its own size."""
        self.config = config
        self.device = torch.device(device)
        self.dtype = DTYPES[resolve_dtype(config.dtype, self.device.type)]
        self.use_graphs = config.cuda_graph if use_graphs is None else use_graphs
        if self.device.type == "cpu":
            torch.set_num_threads(config.threads)
        self.busy_cores = BusyCores()
        arch = load_arch(config.model)
        self.arch = arch
        with torch.device("meta"):
            model = CausalLM(arch)
        model = model.to_empty(device=self.device).to(self.dtype)
        model.load(load_weights(config.model, arch, self.dtype))
        self.quantization = resolve_quantization(
            config.quantization, config.dtype, self.device.type, config.model.path
        )
        if self.quantization != "none":
            assert self.device.type == "cpu", "--quantization runs on the cpu device"
            quantize_model(model, self.quantization, config.model.path, arch)
        log.info("%s: %s activations, %s weights", config.served_model_name,
                 str(self.dtype).removeprefix("torch."), self.quantization)  # fmt: skip
        self.model = model.eval()
        self.num_blocks = self.first_kv_blocks()
        assert self.num_blocks >= 2, "--kv-cache-memory holds less than one KV block"
        self.kv_cache = self.make_kv_cache(self.num_blocks)
        self.max_blocks_per_seq = -(-config.model.max_model_len // config.block_size)
        sizes = capture_sizes(config.max_num_seqs)
        self.batch = PersistentBatch(
            config.max_num_seqs,
            self.max_blocks_per_seq,
            config.block_size,
            max(config.max_num_batched_tokens, sizes[-1]),
            self.device,
        )
        self.compiled = config.compile and self.use_graphs and self.device.type == "cpu"
        forward = self.forward
        if self.compiled:
            forward = partial(self.forward, run_layers=compiled.CompiledLayers())
        self.graphs = DecodeGraphs(forward, sizes)
        self.attn = self.make_attention()
        self.sampler = SamplerState(
            config.max_num_seqs,
            arch.vocab_size,
            self.device,
            max_logprobs=config.max_logprobs,
            seed=config.seed,
            eos_token_ids=tuple(config.model.eos_token_ids),
        )
        self.grammar = GrammarRows(
            load_tokenizer(config.model).to_str(),
            arch.vocab_size,
            tuple(config.model.eos_token_ids),
            config.max_num_seqs,
            self.device,
        )
        self.num_logprobs = np.full(config.max_num_seqs, -1, dtype=np.int64)  # -1: not asked
        # prompt logprobs: per slot, positions below this are scored (0: not asked), top k,
        # and the prompt ids (the targets)
        self.scored_until = np.zeros(config.max_num_seqs, dtype=np.int64)
        self.prompt_top = np.zeros(config.max_num_seqs, dtype=np.int64)
        self.prompt_ids: dict[int, np.ndarray] = {}
        self.last_seq = 0
        if self.compiled:
            sizes = [s for s in compiled.WARM_SIZES if s in self.graphs.sizes]
            if self.quantization == "int4-dual":  # why: past SMALL_ROWS is a third compilation
                sizes += [s for s in self.graphs.sizes if s > SMALL_ROWS][:1]
            try:
                compiled.warm_up(self.prime_decode, sizes)
            except Exception as e:  # why: no C++ compiler (a slim image) must not stop serving
                compiled.log.warning(
                    "cannot compile the cpu decode step, running it eagerly (--no-compile "
                    "skips trying): %s: %s", type(e).__name__, str(e).splitlines()[0][:300],
                )  # fmt: skip
                self.compiled = False
                self.graphs.forward = self.forward

    def first_kv_blocks(self) -> int:
        """KV blocks allocated at start (cuda may size the cache again once it has measured)."""
        return num_kv_blocks(self.arch, self.config, self.dtype)

    def make_kv_cache(self, num_blocks: int) -> list:
        """Per layer (K, V), each [num_blocks * block_size, kv_heads, head_dim], zeros:
        flashinfer's NHD pages. why not one tensor: a compiled step mutates its inputs in place
        only when none is a view"""
        rows, arch = num_blocks * self.config.block_size, self.arch
        return [
            tuple(
                torch.zeros(rows, arch.num_kv_heads, arch.head_dim, dtype=self.dtype,
                            device=self.device)
                for _ in range(2)
            )
            for _ in range(arch.num_layers)
        ]  # fmt: skip

    @torch.inference_mode()
    def prime_decode(self, size: int) -> None:
        """One padded decode step of `size` dummies (token 0 at position 0, K/V into block 0),
        through the graph layer; the runner's state is as before."""
        self.batch.table[:size].zero_()
        ones = np.ones(size, dtype=np.int64)
        layout = StepLayout(ones, ones, np.zeros((size, 1), dtype=np.int64), self.batch.block_size)
        self.graphs.run(size, self.attn.build(layout, self.batch.column(SLOT_MAPPING, size)))
        for kv in self.kv_cache:  # why: block 0 is scratch, but leave no trace of the warm-up
            for cache in kv:
                cache[: self.batch.block_size].zero_()

    def make_attention(self):
        max_context = self.max_blocks_per_seq * self.config.block_size
        bs, scale = self.config.block_size, self.arch.scale
        kernel = self.config.attention_kernel and kernels.available(self.dtype)
        log.info("cpu decode attention: %s", "paged kernel" if kernel else "torch (gather + SDPA)")
        return TorchAttention(self.graphs.max_size, max_context, bs, scale, kernel)

    # the Backend contract: on cpu a launch runs the whole step, so it is ready at once
    def launch(self, plan: StepPlan) -> StepResult:
        return self.execute(plan)

    def seconds_until_ready(self, handle: StepResult) -> float:
        return 0.0

    def collect(self, handle: StepResult) -> StepResult:
        return handle

    # ------------------------------------------------------------------ a step, in parts

    def begin(self, plan: StepPlan) -> None:
        """Check the order and apply the plan's slot changes."""
        # in order; a plan the runner refused (plan_check) leaves a gap
        assert plan.seq > self.last_seq, f"plan {plan.seq} after {self.last_seq}: out of order"
        self.last_seq = plan.seq
        for slot in plan.freed_slots:
            self.batch.remove(slot)
            self.sampler.remove(slot)
            self.scored_until[slot] = 0
            self.prompt_ids.pop(slot, None)
            self.grammar.remove(slot)
        for new in plan.new_slots:
            self.batch.add(new.slot)
            self.sampler.add(new.slot, new.params, new.num_prompt_tokens)
            if new.cached_ids:
                self.sampler.record_cached(new.slot, new.cached_ids)
            self.grammar.add(new.slot, new.params.grammar, new.num_prompt_tokens)
            lp = new.params.logprobs
            self.num_logprobs[new.slot] = -1 if lp is None else min(lp, self.config.max_logprobs)
            if new.params.prompt_logprobs is not None and new.prompt_token_ids:
                self.prompt_ids[new.slot] = np.asarray(new.prompt_token_ids, np.int64)
                self.scored_until[new.slot] = len(new.prompt_token_ids)
                self.prompt_top[new.slot] = min(
                    new.params.prompt_logprobs, self.config.max_logprobs
                )

    def prepare(self, plan: StepPlan) -> tuple[StepInputs, AttentionMeta]:
        """Host work: the static table (not yet uploaded) and the attention plan."""
        self.grammar.feed_plan(plan)
        scored = self.scored_until if self.prompt_ids else None
        inp = self.batch.prepare(plan, pad=self.use_graphs, scored_until=scored)
        meta = self.attn.build(inp.layout, self.batch.column(SLOT_MAPPING, inp.num_rows))
        return inp, meta

    def forward(
        self,
        num_rows: int,
        meta: AttentionMeta,
        num_logits: int | None = None,
        run_layers: Callable | None = None,
    ) -> torch.Tensor:  # [num_logits, vocab] float32
        """The model over the first num_rows rows of the static table; what the graphs hold."""
        fed = self.batch.column(IDS, num_rows)
        from_device = self.batch.last_token[self.batch.column(TOK_SLOT, num_rows)]
        input_ids = torch.where(fed >= 0, fed, from_device)  # [rows] long
        positions = self.batch.column(POSITIONS, num_rows)
        logit_rows = self.batch.column(LOGIT_ROWS, num_rows if num_logits is None else num_logits)
        return self.model(input_ids, positions, self.kv_cache, meta, logit_rows, run_layers)

    def run_model(self, inp: StepInputs, meta: AttentionMeta) -> torch.Tensor:
        """[B_s + P, vocab] float32 logits of the sampling entries in entry order, then of the
        P prompt rows scored for prompt logprobs."""
        self.batch.upload(inp)
        if self.device.type == "cpu" and self.config.threads > 1:
            self._size_threads(inp.num_rows)
        num_logits = inp.num_sample + inp.num_scored
        if inp.padded:
            return self.graphs.run(inp.num_rows, meta)[:num_logits]
        return self.forward(inp.num_rows, meta, num_logits)

    def _size_threads(self, rows: int) -> None:
        """One thread for a one-row step while other programs keep the cores busy."""
        want = 1 if rows == 1 and self.busy_cores() else self.config.threads
        if want != torch.get_num_threads():
            log.debug("cpu threads: %d (%s)", want, "cores busy" if want == 1 else "cores free")
            torch.set_num_threads(want)

    def score_prompt(self, inp: StepInputs, logits: torch.Tensor) -> list[PromptLogprobs]:
        """Prompt logprobs of the scored rows (logits [P, V]), one PromptLogprobs per run of
        consecutive rows of a slot. Host lists: this waits for the device."""
        if not inp.num_scored:
            return []
        assert inp.scored_slots_host is not None and inp.scored_positions_host is not None
        slots, positions = inp.scored_slots_host, inp.scored_positions_host
        targets = np.asarray(
            [self.prompt_ids[s][p] for s, p in zip(slots, positions, strict=True)], np.int64
        )
        k = int(self.prompt_top[slots].max())
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [P, 1]
        target = torch.from_numpy(targets).to(logits.device)[:, None]
        chosen = (logits.gather(1, target) - lse).squeeze(1).tolist()
        top_vals, top_ids = logits.topk(k, dim=-1) if k else (lse[:, :0], lse[:, :0].long())
        top_lp, top_id = (top_vals - lse).tolist(), top_ids.tolist()
        out: list[PromptLogprobs] = []
        for j in range(len(slots)):
            slot, kk = int(slots[j]), int(self.prompt_top[slots[j]])
            lp = SampleLogprobs(chosen[j], top_id[j][:kk], top_lp[j][:kk])
            last = out[-1] if out else None
            if (
                last is not None
                and last.slot == slot
                and last.start + len(last.token_ids) == positions[j]
            ):
                last.token_ids.append(int(targets[j]))
                last.logprobs.append(lp)
            else:
                out.append(PromptLogprobs(slot, int(positions[j]), [int(targets[j])], [lp]))
        return out

    def sample(self, inp: StepInputs, logits: torch.Tensor) -> SampleOutput:
        """Sample, write last_token, and count the step's tokens for penalties; no host sync."""
        col = self.batch.column
        if inp.num_fed:
            fed_slots = col(FED_SLOTS, inp.num_fed)
            fed = (fed_slots, col(FED_POSITIONS, inp.num_fed), col(FED_IDS, inp.num_fed))
            self.sampler.record(*fed, inp.fed_slots_host)
        slots = col(SAMPLE_SLOTS, inp.num_sample)
        positions = col(SAMPLE_POSITIONS, inp.num_sample)
        host = inp.sample_slots_host
        constrain = None
        if self.grammar.any_in(host):
            constrain = lambda x, inplace: self.grammar.apply(x, host, inplace)  # noqa: E731
        out = self.sampler.sample(logits, slots, positions, host, constrain)
        self.batch.last_token[slots] = out.token_ids
        if not out.plain:  # plain: no penalty, bad word or grammar keeps count of outputs
            self.sampler.record(slots, positions, out.token_ids, host)
            self.grammar.remember(host, out.token_ids)
        return out

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        received = time.perf_counter()
        self.begin(plan)
        if not plan.slots:
            return StepResult(
                seq=plan.seq,
                token_ids=[],
                timing=StepTiming(received, received, received, received, time.perf_counter()),
            )
        inp, meta = self.prepare(plan)
        launched = time.perf_counter()
        logits = self.run_model(inp, meta)
        forwarded = time.perf_counter()
        out = self.sample(inp, logits[: inp.num_sample])
        result = step_result(plan.seq, out, self.num_logprobs[inp.sample_slots_host])
        result.prompt_logprobs = self.score_prompt(inp, logits[inp.num_sample :])
        device_end = time.perf_counter()
        result.timing = StepTiming(
            plan_received=received,
            launched=launched,
            device_start=launched,
            device_end=device_end,
            published=time.perf_counter(),
            prepare_s=launched - received,
            forward_s=forwarded - launched,
            sample_s=device_end - forwarded,
        )
        return result
