"""One step on a real device, whichever it is: the plan's slot changes applied to the persistent
batch, the step's inputs prepared from the plan, the model run over the paged KV cache (padded
decode batches through the graph layer), sampling, and the result published with its timeline.

The executor knows no device: a backend gives it its pieces (gpu_runner/device.py) and composes
it (gpu_runner/cpu/backend.py, gpu_runner/cuda/backend.py). `launch` queues a step and returns
its handle; `collect` waits for its ids and builds the StepResult; on the host both halves run
at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from gapless.common.config import EngineConfig
from gapless.common.messages import PromptLogprobs, StepPlan, StepResult, StepTiming
from gapless.common.model_files import ModelArch, load_tokenizer
from gapless.gpu_runner.attention import AttentionMeta, StepLayout
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
    StepInputs,
)
from gapless.gpu_runner.device import DeviceParts
from gapless.gpu_runner.draft_model import DraftModel
from gapless.gpu_runner.graph import DecodeGraphs, capture_sizes
from gapless.gpu_runner.kv_cache import KVCache, make_kv_cache
from gapless.gpu_runner.lora.stack import LoraStack
from gapless.gpu_runner.model import CausalLM
from gapless.gpu_runner.model.projection import StepContext
from gapless.gpu_runner.pooling import Pooler, embedding_bytes
from gapless.gpu_runner.sampling.grammar import GrammarRows
from gapless.gpu_runner.sampling.logprobs import SampleOutput, row_logprobs
from gapless.gpu_runner.sampling.prompt_logprobs import PromptScores
from gapless.gpu_runner.sampling.sampler import SamplerState
from gapless.gpu_runner.speculate import Drafts
from gapless.gpu_runner.verify import verify

_NO_ASKS = np.zeros(0, dtype=np.int64)


@dataclass
class Launched:
    """A launched step: its host times (perf_counter), the timeline's marks and the copy of
    its ids to the host."""

    seq: int
    received: float
    prepared: float  # inputs ready, the model about to run
    returned: float  # the launch returned
    start: Any  # marks: before the model, after it, after sampling
    forwarded: Any
    end: Any
    copy: Any  # the ResultCopy's handle
    num_logprobs: np.ndarray  # [B_s] int64: each sampled row's ask (-1: none)
    # why computed at launch: only requests that ask for prompt logprobs pay the wait it costs
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    # embedding requests that sampled: [P, hidden] float32 on device, [P] their sampled rows
    pooled: tuple[torch.Tensor, np.ndarray] | None = None


def step_result(seq: int, out: SampleOutput, num_logprobs: np.ndarray) -> StepResult:
    """out holds host tensors; num_logprobs [B_s] is each sampled row's ask (-1: none)."""
    result = StepResult(seq=seq, token_ids=out.token_ids.tolist())
    if out.counts is not None:
        result.counts, result.num_drafted = out.counts.tolist(), out.num_drafted.tolist()
    if out.logprobs is not None:
        result.logprobs = row_logprobs(num_logprobs, out.logprobs, out.top_ids, out.top_logprobs)
    return result


class StepExecutor:
    def __init__(
        self,
        config: EngineConfig,
        arch: ModelArch,
        model: CausalLM,
        dtype: torch.dtype,
        num_blocks: int,
        parts: DeviceParts,
    ) -> None:
        self.config = config
        self.arch = arch
        self.model = model
        self.dtype = dtype
        self.device = parts.device
        self.num_blocks = num_blocks
        self.kv_cache: KVCache = self.make_kv_cache(num_blocks)
        self.batch = parts.batch
        self.attn = parts.attention
        self.timeline = parts.timeline
        self.results = parts.results
        self.use_graphs = parts.pad
        self.before_forward = parts.before_forward
        forward: Callable = self.forward
        if parts.run_layers is not None:
            forward = partial(self.forward, run_layers=parts.run_layers)
        self.graphs = DecodeGraphs(forward, capture_sizes(config.max_num_seqs))
        eos = tuple(config.model.eos_token_ids)
        slots = config.max_num_seqs
        self.sampler = SamplerState(slots, arch.vocab_size, self.device, config.max_logprobs,
                                    config.seed, eos, parts.sampling)  # fmt: skip
        tokenizer = load_tokenizer(config.model).to_str()
        self.grammar = GrammarRows(tokenizer, arch.vocab_size, eos, slots, self.device)
        self.num_logprobs = np.full(slots, -1, dtype=np.int64)  # -1: not asked
        self.prompts = PromptScores(slots, config.max_logprobs)
        self.pooler = Pooler(slots, arch.hidden_size, self.device)
        self.drafts = Drafts(slots)
        self.draft: DraftModel | None = None  # --speculative draft's model (the backend's)
        self.draft_q: dict[int, torch.Tensor] = {}  # slot -> [d, V] q of its drafts this step
        self.last_seq = 0
        self.lora: LoraStack | None = None  # resident LoRA adapters (the backend's)
        self.plan_slots: list[int] = []  # the step's entries' slots

    def make_kv_cache(self, num_blocks: int) -> KVCache:
        bs = self.config.block_size
        return make_kv_cache(self.arch, num_blocks, bs, self.dtype, self.device)

    # ------------------------------------------------------------------ the Backend contract

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> Launched:
        """Queue the step (on the host: run it); nothing here waits for the device."""
        received = time.perf_counter()
        self.begin(plan)
        if not plan.slots:
            mark = self.timeline.mark()
            copy = self.results.start(None, mark)
            return Launched(plan.seq, received, received, received, mark, mark, mark, copy,
                            _NO_ASKS)  # fmt: skip
        pooling = self.pooler.in_plan(plan)
        inp, meta = self.prepare(plan, pooling)
        prepared = time.perf_counter()
        start = self.timeline.mark()
        if pooling:
            logits = self.run_pooling(plan, inp, meta)
        else:
            logits = self.run_model(inp, meta)
        forwarded = self.timeline.mark()
        out = self.sample(inp, logits[: inp.num_sample])
        end = self.timeline.mark()
        scored = self.prompts.score(inp, logits[inp.num_sample :])
        pooled = self.pooler.take(inp.sample_slots_host) if pooling else None
        asks = self.num_logprobs[inp.sample_slots_host]
        if out.counts is not None:  # a verify: asks per output token
            asks = np.repeat(self.num_logprobs[inp.entry_slots_host], out.counts)
        return Launched(
            seq=plan.seq,
            received=received,
            prepared=prepared,
            returned=time.perf_counter(),
            start=start,
            forwarded=forwarded,
            end=end,
            copy=self.results.start(out, end),
            num_logprobs=asks,
            prompt_logprobs=scored,
            pooled=pooled,
        )

    def seconds_until_ready(self, handle: Launched) -> float:
        return self.results.seconds_until_ready(handle.copy)

    def collect(self, handle: Launched) -> StepResult:
        """The step's ids and timeline; waits for the copy of its ids."""
        host = self.results.wait(handle.copy)
        if host is None:
            result = StepResult(handle.seq, [])
        else:
            result = step_result(handle.seq, host, handle.num_logprobs)
            result.prompt_logprobs = handle.prompt_logprobs
            if handle.pooled is not None:
                result.embeddings = embedding_bytes(*handle.pooled, len(result.token_ids))
        h, clock = handle, self.timeline
        result.timing = StepTiming(
            plan_received=h.received,
            launched=clock.launched(h.start, h.returned),
            device_start=clock.host_time(h.start),
            device_end=clock.host_time(h.end),
            published=time.perf_counter(),
            prepare_s=h.prepared - h.received,
            forward_s=clock.seconds(h.start, h.forwarded),
            sample_s=clock.seconds(h.forwarded, h.end),
        )
        return result

    def execute(self, plan: StepPlan) -> StepResult:
        """Launch and collect one plan."""
        return self.collect(self.launch(plan))

    # ------------------------------------------------------------------ a step, in parts

    def begin(self, plan: StepPlan) -> None:
        """Check the order and apply the plan's slot changes."""
        # in order; a plan the runner refused (plan_check) leaves a gap
        assert plan.seq > self.last_seq, f"plan {plan.seq} after {self.last_seq}: out of order"
        self.last_seq = plan.seq
        self.plan_slots = plan.slots
        for slot in plan.freed_slots:
            if self.lora is not None:
                self.lora.bind(slot, "")
            self.batch.remove(slot)
            self.sampler.remove(slot)
            self.prompts.remove(slot)
            self.grammar.remove(slot)
            self.pooler.remove(slot)
            self.drafts.remove(slot)
        for new in plan.new_slots:
            assert self.lora is not None or not new.lora, "an adapter without --enable-lora"
            if self.lora is not None:
                self.lora.bind(new.slot, new.lora)
            self.batch.add(new.slot, drafting=bool(new.draft_method))
            self.sampler.add(new.slot, new.params, new.num_prompt_tokens)
            if new.cached_ids:
                self.sampler.record_cached(new.slot, new.cached_ids)
            self.grammar.add(new.slot, new.params.grammar, new.num_prompt_tokens)
            lp = new.params.logprobs
            self.num_logprobs[new.slot] = -1 if lp is None else min(lp, self.config.max_logprobs)
            self.prompts.add(new)
            self.pooler.add(new.slot, new.params.pooling, new.num_prompt_tokens)
            if self.draft is not None:
                self.draft.reset(new.slot)
            if new.draft_method:
                self.drafts.add(
                    new.slot, new.draft_method, new.prediction, new.cached_ids, new.tenant
                )

    def prepare(self, plan: StepPlan, pooling: bool = False) -> tuple[StepInputs, AttentionMeta]:
        """Host work: the static table (not yet uploaded) and the attention plan. A step with
        a pooling slot runs unpadded (its rows are the plan's tokens, in order)."""
        self.grammar.feed_plan(plan)
        drafts, self.draft_q = None, {}
        self.batch.append_blocks(plan)  # why first: a draft model writes KV into new blocks
        if self.drafts.active.any():
            drafts = self._draft(plan)
        inp = self.batch.prepare(
            plan,
            pad=self.use_graphs and not pooling,
            scored_until=self.prompts.asked(),
            drafts=drafts,
            blocks_appended=True,
        )
        meta = self.attn.build(inp.layout, self.batch.column(SLOT_MAPPING, inp.num_rows))
        return inp, meta

    def _draft(self, plan: StepPlan) -> list[list[int]] | None:
        """Note the ids the plan feeds to drafting slots; the drafts of each entry the plan
        lets verify some ([B]), or None."""
        drafts, at = self.drafts, 0
        for slot, n, has in zip(plan.slots, plan.num_tokens, plan.has_tokens, strict=True):
            if has:
                if drafts.active[slot]:
                    drafts.fed(slot, plan.token_ids[at : at + n])
                at += n
        if not plan.num_draft:
            return None
        out = [
            drafts.propose(slot, k) if k else []
            for slot, k in zip(plan.slots, plan.num_draft, strict=True)
        ]
        if self.draft is not None:
            self._draft_model(plan, out)
        return out

    def _draft_model(self, plan: StepPlan, out: list[list[int]]) -> None:
        """The draft model's drafts for its entries of the plan, into out [B]; q of each
        sampled row's drafts into draft_q, by slot (gpu_runner/verify.py reads them)."""
        assert self.draft is not None
        entries = [
            j
            for j, (slot, k) in enumerate(zip(plan.slots, plan.num_draft, strict=True))
            if k and self.drafts.method[slot] == "draft"
        ]
        if not entries:
            return
        slots = np.asarray([plan.slots[j] for j in entries], np.int64)
        known = np.fromiter((len(self.drafts.tokens[s]) for s in slots), np.int64, len(slots))
        assert (self.batch.length[slots] == known - 1).all(), "a slot's tokens and KV disagree"
        ks = np.asarray([plan.num_draft[j] for j in entries], np.int64)
        tokens = [self.drafts.tokens[s] for s in slots.tolist()]
        ids, qs = self.draft.propose(slots, ks, tokens, self.sampler.draw_params(slots))
        for j, slot, d, q in zip(entries, slots.tolist(), ids, qs, strict=True):
            out[j] = d
            if q is not None:
                self.draft_q[slot] = q

    def forward(
        self,
        num_rows: int,
        meta: AttentionMeta,
        num_logits: int | None = None,
        run_layers: Callable | None = None,
        pool_rows: torch.Tensor | None = None,
    ) -> Any:
        """The model over the first num_rows rows of the static table; what the graphs hold.
        [num_logits, vocab] float32 logits; with pool_rows, (logits, [K, hidden] float32)."""
        fed = self.batch.column(IDS, num_rows)
        from_device = self.batch.last_token[self.batch.column(TOK_SLOT, num_rows)]
        input_ids = torch.where(fed >= 0, fed, from_device)  # [rows] long
        positions = self.batch.column(POSITIONS, num_rows)
        logit_rows = self.batch.column(LOGIT_ROWS, num_rows if num_logits is None else num_logits)
        ctx = self.step_context(num_rows)
        return self.model(
            input_ids, positions, self.kv_cache, meta, logit_rows, run_layers, pool_rows, ctx
        )

    def step_context(self, num_rows: int) -> StepContext:
        """The layers' per-token context of the first num_rows rows of the static table."""
        slots = self.batch.column(TOK_SLOT, num_rows)
        if self.lora is None:
            return StepContext(slots=slots)
        return self.lora.context(slots, self.plan_slots)

    def run_model(self, inp: StepInputs, meta: AttentionMeta) -> torch.Tensor:
        """[B_s + P, vocab] float32 logits of the sampling entries in entry order, then of the
        P prompt rows scored for prompt logprobs."""
        self.batch.upload(inp)
        if self.before_forward is not None:
            self.before_forward(inp.num_rows)
        num_logits = inp.num_sample + inp.num_scored
        if inp.padded:
            return self.graphs.run(inp.num_rows, meta)[:num_logits]
        return self.forward(inp.num_rows, meta, num_logits)

    def run_pooling(self, plan: StepPlan, inp: StepInputs, meta: AttentionMeta) -> torch.Tensor:
        """run_model for a step with pooling slots (unpadded): the logits, and each pooling
        slot's kept hidden states added to its pool."""
        assert not inp.padded
        rows, slots = self.pooler.rows(plan)
        self.batch.upload(inp)
        if self.before_forward is not None:
            self.before_forward(inp.num_rows)
        pool_rows = torch.from_numpy(rows).to(self.device)
        num_logits = inp.num_sample + inp.num_scored
        logits, hidden = self.forward(inp.num_rows, meta, num_logits, pool_rows=pool_rows)
        if len(rows):
            self.pooler.accumulate(hidden, slots)
        return logits

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
        if inp.sample_counts is not None:
            return verify(self, inp, logits, slots, positions)
        constrain = None
        if self.grammar.any_in(host):
            constrain = lambda x, inplace: self.grammar.apply(x, host, inplace)  # noqa: E731
        out = self.sampler.sample(logits, slots, positions, host, constrain)
        self.batch.last_token[slots] = out.token_ids
        if not out.plain:  # plain: no penalty, bad word or grammar keeps count of outputs
            self.sampler.record(slots, positions, out.token_ids, host)
            self.grammar.remember(host, out.token_ids)
        if self.drafts.any_in(host):  # why the host copy: the drafts of the next step read it
            for slot, token in zip(host.tolist(), out.token_ids.tolist(), strict=True):
                if self.drafts.active[slot]:
                    self.drafts.sampled(slot, [token])
        return out

    @torch.inference_mode()
    def prime_decode(self, size: int) -> None:
        """One padded decode step of `size` dummies (token 0 at position 0, K/V into block 0),
        through the graph layer; the executor's state is as before."""
        self.batch.table[:size].zero_()
        ones = np.ones(size, dtype=np.int64)
        layout = StepLayout(ones, ones, np.zeros((size, 1), dtype=np.int64), self.batch.block_size)
        self.graphs.run(size, self.attn.build(layout, self.batch.column(SLOT_MAPPING, size)))
        for kv in self.kv_cache:  # why: block 0 is scratch, but leave no trace of the warm-up
            for cache in kv:
                cache[: self.batch.block_size].zero_()
