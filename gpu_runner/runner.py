"""Executes step plans on the cpu device: model, paged KV cache, persistent batch, sampler."""

from __future__ import annotations

import time

import numpy as np
import torch

from core.config import EngineConfig
from core.messages import StepPlan, StepResult, StepTiming
from core.model_files import ModelArch, load_arch
from gpu_runner.batch import PersistentBatch
from gpu_runner.model import LlamaModel, rope_inv_freq
from gpu_runner.sampler import SamplerState
from gpu_runner.weights import load_weights

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def num_kv_blocks(arch: ModelArch, config: EngineConfig, dtype: torch.dtype) -> int:
    """Blocks that fit in --kv-cache-memory, and no more than max_num_seqs full contexts need."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_block = 2 * arch.num_layers * config.block_size * arch.num_kv_heads * arch.head_dim * elem
    fit = config.kv_cache_memory // per_block
    per_seq = -(-config.model.max_model_len // config.block_size)
    return int(min(fit, config.max_num_seqs * per_seq + 1))


class ModelRunner:
    def __init__(self, config: EngineConfig, device: str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = DTYPES[config.dtype]
        if self.device.type == "cpu":
            torch.set_num_threads(config.threads)
        arch = load_arch(config.model)
        self.arch = arch
        with torch.device("meta"):
            model = LlamaModel(arch)
        model = model.to_empty(device=self.device).to(self.dtype)
        model.load(load_weights(config.model, arch, self.dtype))
        model.inv_freq = rope_inv_freq(arch).to(self.device)  # buffers made on meta hold garbage
        self.model = model.eval()
        self.num_blocks = num_kv_blocks(arch, config, self.dtype)
        assert self.num_blocks >= 2, "--kv-cache-memory holds less than one KV block"
        rows = self.num_blocks * config.block_size
        # [layers, K|V, rows, kv_heads, head_dim]
        self.kv_cache = torch.zeros(
            arch.num_layers,
            2,
            rows,
            arch.num_kv_heads,
            arch.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        max_blocks = -(-config.model.max_model_len // config.block_size)
        self.batch = PersistentBatch(
            config.max_num_seqs, max_blocks, config.block_size, self.device
        )
        self.sampler = SamplerState(
            config.max_num_seqs,
            arch.vocab_size,
            self.device,
            max_logprobs=config.max_logprobs,
            seed=config.seed,
        )
        self.num_logprobs = np.full(config.max_num_seqs, -1, dtype=np.int64)  # -1: not asked
        self.last_seq = 0

    # the Backend contract: on cpu a launch runs the whole step, so it is ready at once
    def launch(self, plan: StepPlan) -> StepResult:
        return self.execute(plan)

    def seconds_until_ready(self, handle: StepResult) -> float:
        return 0.0

    def collect(self, handle: StepResult) -> StepResult:
        return handle

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        received = time.perf_counter()
        assert plan.seq == self.last_seq + 1, f"plan {plan.seq} after {self.last_seq}: out of order"
        self.last_seq = plan.seq
        for slot in plan.freed_slots:
            self.batch.remove(slot)
            self.sampler.remove(slot)
        for new in plan.new_slots:
            self.batch.add(new.slot)
            self.sampler.add(new.slot, new.params, new.num_prompt_tokens)
            lp = new.params.logprobs
            self.num_logprobs[new.slot] = -1 if lp is None else min(lp, self.config.max_logprobs)
        if not plan.slots:
            now = time.perf_counter()
            return StepResult(
                seq=plan.seq,
                token_ids=[],
                logprobs=[],
                top_counts=[],
                top_ids=[],
                top_logprobs=[],
                timing=StepTiming(received, now, now, now, now),
            )
        inp = self.batch.prepare(plan)
        launched = time.perf_counter()
        logits = self.model(inp.input_ids, inp.positions, self.kv_cache, inp.meta, inp.logit_rows)
        forwarded = time.perf_counter()
        if inp.fed_ids.numel():
            self.sampler.record(inp.fed_slots, inp.fed_positions, inp.fed_ids, inp.fed_slots_host)
        host = inp.sample_slots_host
        out = self.sampler.sample(logits, inp.sample_slots, inp.sample_positions, host)
        self.batch.last_token[inp.sample_slots] = out.token_ids
        self.sampler.record(inp.sample_slots, inp.sample_positions, out.token_ids, host)
        ids = out.token_ids.tolist()
        device_end = time.perf_counter()
        result = StepResult(
            seq=plan.seq, token_ids=ids, logprobs=[], top_counts=[], top_ids=[], top_logprobs=[]
        )
        if out.logprobs is not None:
            k = np.maximum(self.num_logprobs[host], 0)  # [B_s] top entries each row asked for
            result.logprobs = out.logprobs.tolist()
            result.top_counts = k.tolist()
            if k.any():
                keep = np.arange(out.top_ids.shape[1])[None, :] < k[:, None]  # [B_s, K]
                keep_t = torch.as_tensor(keep)
                result.top_ids = out.top_ids[keep_t].tolist()
                result.top_logprobs = out.top_logprobs[keep_t].tolist()
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
