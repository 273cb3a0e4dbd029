"""The `sim` device: an asynchronous accelerator emulated from a timing profile, no weights.

A launch does the host-side work of a real runner (slots, and the persistent batch's block
tables and static token table, by the executor's own batch: gpu_runner/batch.py) and queues
the step on an emulated device that runs steps back to back:
device_start = max(launch time, device_free_at), device_end = device_start + t_step (the
profile's modelled time, sim). Sampled ids are drawn from a seeded generator over the real
tokenizer's ordinary tokens, never EOS or special tokens, so requests end by length or stop
strings and detokenization does real work. An embedding request (SamplingParams.pooling) gets
a stand-in vector of the model's hidden size, drawn from a generator seeded by the engine's
seed and its prompt length: deterministic, and meaningless (sim).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch

from gapless.common.config import EngineConfig
from gapless.common.messages import SampleLogprobs, StepPlan, StepResult, StepTiming
from gapless.common.model_files import load_arch, load_tokenizer
from gapless.gpu_runner.batch import SLOT_MAPPING, batch_for
from gapless.gpu_runner.sampling.grammar import GrammarRows
from gapless.gpu_runner.sampling.logprobs import row_logprobs
from gapless.gpu_runner.sim.profiles import get_profile, num_kv_blocks, step_costs, step_time


def ordinary_token_ids(config: EngineConfig) -> np.ndarray:
    """[V'] int64: ids of the tokenizer that are not added/special tokens or EOS and decode
    to visible text (byte pieces that decode to U+FFFD alone are left out too)."""
    tok = load_tokenizer(config.model)
    n = tok.get_vocab_size(with_added_tokens=True)
    excluded = set(tok.get_added_tokens_decoder()) | set(config.model.eos_token_ids)
    texts = tok.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    ids = [i for i, t in enumerate(texts) if i not in excluded and t.strip() and "\ufffd" not in t]
    assert ids, f"{config.model.path}: the tokenizer has no ordinary tokens"
    return np.asarray(ids, dtype=np.int64)


@dataclass
class SimStep:
    """A launched step: its sampled ids and emulated device timeline (perf_counter seconds)."""

    seq: int
    token_ids: np.ndarray  # [B_s] int64
    asks: np.ndarray  # [B_s] int64, logprobs each sampled row asked for (-1: none)
    pooled: np.ndarray  # [B_s] int64, the prompt length of each row that pools (0: none)
    received: float
    launched: float
    device_start: float
    device_end: float
    ready_at: float  # device_end plus the modelled device-to-host copy
    # a verify step: [E_s] tokens of each sampled entry and [E_s] drafts it verified
    counts: np.ndarray | None = None
    num_drafted: np.ndarray | None = None


class SimBackend:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.profile = get_profile(config.sim_profile)
        if config.tensor_parallel_size > 1:  # weights, heads and KV over that many GPUs
            self.profile = dataclasses.replace(self.profile, tp=config.tensor_parallel_size)
        self.num_blocks = num_kv_blocks(
            self.profile, config.block_size, config.max_num_seqs, config.model.max_model_len
        )
        assert self.num_blocks >= 2, f"{self.profile.name}: no room for KV blocks"
        self.vocab = ordinary_token_ids(config)
        # why two streams: launches and collects interleave by timing, draws must not
        self.rng = np.random.default_rng([config.seed, 0])  # sampled ids, at launch
        self.top_rng = np.random.default_rng([config.seed, 1])  # top-logprob ids, at collect
        slots = config.max_num_seqs
        self.batch = batch_for(config, "cpu", self.num_blocks)
        self.num_logprobs = np.full(slots, -1, dtype=np.int64)  # -1: not asked
        self.pooling = np.zeros(slots, dtype=np.int64)  # prompt length of a pooling slot, or 0
        self.hidden_size = load_arch(config.model).hidden_size
        # top-k logprobs of rank r: log(2^-(r+1)), the sampled token at rank 0 (sim)
        k = max(config.max_logprobs, 1)
        self.rank_logprobs = -np.log(2.0) * np.arange(1, k + 1)
        self.step_costs = step_costs(
            self.profile, config.max_num_batched_tokens, config.sim_time_scale
        )
        self.spec_rng = np.random.default_rng([config.seed, 3])  # drafts accepted, at launch
        self._verify: tuple[np.ndarray, np.ndarray] | None = None  # the step's [E_s] counts, slots
        self.device_free_at = 0.0
        self.last_seq = 0
        # constrained rows run their real grammar masks on the host (their CPU cost is real);
        # the token is a random one the grammar allows, so a constrained stream stays valid
        self.grammar = GrammarRows(
            load_tokenizer(config.model).to_str(),
            config.model.vocab_size,
            tuple(config.model.eos_token_ids),
            slots,
            torch.device("cpu"),
        )

    # ------------------------------------------------------------------ the Backend contract

    def launch(self, plan: StepPlan) -> SimStep:
        received = time.perf_counter()
        # in order; a plan the runner refused (plan_check) leaves a gap
        assert plan.seq > self.last_seq, f"plan {plan.seq} after {self.last_seq}: out of order"
        self.last_seq = plan.seq
        self._apply_slots(plan)
        if not plan.slots:
            none = np.zeros(0, np.int64)
            return SimStep(plan.seq, none, none, none, received, received, received, received,
                           received)  # fmt: skip
        num_tokens, num_prefill, total_context, attended, sample_slots = self._prepare(plan)
        counts = drafted = None
        if self._verify is not None:  # one token per entry, then its accepted drafts
            counts, drafted = self._accept(*self._verify)
            sample_slots = np.repeat(self._verify[1], counts)
        token_ids = self.vocab[self.rng.integers(0, len(self.vocab), len(sample_slots))]
        if self.grammar.any_in(sample_slots):
            token_ids = self._constrain(sample_slots, token_ids)
        t_step = self.config.sim_time_scale * step_time(
            self.profile, num_tokens, len(plan.slots), total_context, num_prefill, attended
        )
        if drafted is not None:  # the sampler's rounds, one per draft position
            t_step += (
                self.config.sim_time_scale
                * self.profile.verify_round_us
                * 1e-6
                * int(drafted.max())
            )
        launched = time.perf_counter()
        start = max(launched, self.device_free_at)
        end = start + t_step
        self.device_free_at = end
        asks = self.num_logprobs[sample_slots]
        ready = end + self.profile.d2h_us * 1e-6
        pooled = self.pooling[sample_slots]
        return SimStep(plan.seq, token_ids, asks, pooled, received, launched, start, end, ready,
                       counts, drafted)  # fmt: skip

    def seconds_until_ready(self, handle: SimStep) -> float:
        return max(0.0, handle.ready_at - time.perf_counter())

    def collect(self, handle: SimStep) -> StepResult:
        wait = handle.ready_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        result = StepResult(seq=handle.seq, token_ids=handle.token_ids.tolist())
        if handle.counts is not None and handle.num_drafted is not None:
            result.counts, result.num_drafted = handle.counts.tolist(), handle.num_drafted.tolist()
        if (handle.asks >= 0).any():
            result.logprobs = self._logprobs(handle)
        if handle.pooled.any():
            result.embeddings = [self._vector(int(n)) if n else b"" for n in handle.pooled]
        h = handle
        result.timing = StepTiming(
            plan_received=h.received,
            launched=h.launched,
            device_start=h.device_start,
            device_end=h.device_end,
            published=time.perf_counter(),
            prepare_s=h.launched - h.received,
            forward_s=h.device_end - h.device_start,
        )
        return result

    # ------------------------------------------------------------------ host-side work

    def _constrain(self, sample_slots: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
        """Constrained rows draw uniformly among the ids their grammar allows next."""
        noise = torch.from_numpy(
            self.rng.random((len(sample_slots), self.config.model.vocab_size), dtype=np.float32)
        )
        allowed = self.grammar.apply(noise, sample_slots).argmax(dim=-1)  # [B_s]
        rows = np.flatnonzero(self.grammar.constrained[sample_slots])
        token_ids = token_ids.copy()
        token_ids[rows] = allowed.numpy()[rows]
        self.grammar.remember(sample_slots, torch.from_numpy(token_ids))
        return token_ids

    def _apply_slots(self, plan: StepPlan) -> None:
        for slot in plan.freed_slots:
            self.batch.remove(slot)
            self.num_logprobs[slot] = -1
            self.pooling[slot] = 0
            self.grammar.remove(slot)
        for new in plan.new_slots:
            self.grammar.add(new.slot, new.params.grammar, new.num_prompt_tokens)
            self.batch.add(new.slot, drafting=bool(new.draft_method))
            lp = new.params.logprobs
            self.num_logprobs[new.slot] = -1 if lp is None else min(lp, self.config.max_logprobs)
            self.pooling[new.slot] = new.num_prompt_tokens if new.params.pooling else 0

    def _prepare(self, plan: StepPlan) -> tuple[int, int, int, int, np.ndarray]:
        self.grammar.feed_plan(plan)
        return self._prepare_inputs(plan)

    def _prepare_inputs(self, plan: StepPlan) -> tuple[int, int, int, int, np.ndarray]:
        """The runner's input preparation (a padded decode batch, as its graphs run them).

        Returns (tokens, prompt tokens, sum of contexts, sum of keys attended, sampling slots).
        """
        bs, b = self.config.block_size, len(plan.slots)
        drafts = None  # sim drafts carry no text: stand-in ids, accepted at the profile's rate
        if plan.num_draft and any(plan.num_draft):
            drafts = [[int(self.vocab[0])] * k for k in plan.num_draft]
        inp = self.batch.prepare(plan, pad=True, drafts=drafts)
        self._verify = None
        if inp.sample_counts is not None:
            assert inp.entry_slots_host is not None
            self._verify = (inp.sample_counts, inp.entry_slots_host)
        n, ctx = inp.layout.num_tokens[:b], inp.layout.ctx_len[:b]  # [B] each
        assert (self.batch.num_blocks[plan.slots] * bs >= ctx).all(), "plan outruns its KV blocks"
        t = inp.num_tokens
        assert (self.batch.table.numpy()[:t, SLOT_MAPPING] >= bs).all(), (
            "a token would be written to the reserved block 0"
        )
        # keys attended: query i of an entry sees start + i + 1 keys (causal)
        attended = int((n * (ctx - n) + n * (n + 1) // 2).sum())
        return t, inp.num_fed, int(ctx.sum()), attended, inp.sample_slots_host

    def _accept(self, cnt: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[E_s] tokens each entry of a verify yields and [E_s] drafts it verified: each draft
        accepted with the profile's rate after the one before it was (sim). The slots'
        lengths give back the rejected drafts' positions, as the runner's verify does."""
        drafted = cnt - 1
        width = max(int(drafted.max()), 1)
        hits = self.spec_rng.random((len(cnt), width)) < self.profile.spec_acceptance
        hits &= np.arange(width)[None, :] < drafted[:, None]
        run = hits.cumprod(axis=1).sum(axis=1) + 1  # [E_s]
        self.batch.length[slots] -= cnt - run
        return run, drafted

    def _vector(self, num_prompt: int) -> bytes:
        """The stand-in embedding of a prompt of this length: little-endian float32 (sim)."""
        rng = np.random.default_rng([self.config.seed, 2, num_prompt])
        return rng.standard_normal(self.hidden_size, dtype=np.float32).astype("<f4").tobytes()

    def _logprobs(self, h: SimStep) -> list[SampleLogprobs | None]:
        """Sampled token at rank 0 of a halving distribution; the rest random ordinary ids."""
        b, k = len(h.asks), int(h.asks.max())  # rows, most top entries a row asked for
        top_ids = self.vocab[self.top_rng.integers(0, len(self.vocab), (b, max(k, 1)))]
        top_ids[:, 0] = h.token_ids  # [B_s, K]
        top_lps = np.broadcast_to(self.rank_logprobs[: max(k, 1)], top_ids.shape)
        return row_logprobs(h.asks, np.full(b, self.rank_logprobs[0]), top_ids, top_lps)
