"""Vectorized sampling over the runner's persistent batch.

Per-slot parameters live twice: in host numpy tables, so batch-level flags ("all greedy",
"any top_p") cost no device sync, and in device copies of the same tables, uploaded when a slot
changes. Randomness is a counter-based hash of (seed, position, vocab id), so a seeded request
samples the same tokens whatever batch or slot it lands in, with no per-row generator state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from gapless.common.messages import SamplingParams
from gapless.gpu_runner.sampling.draws import UNSEEDED_SALT, exponentials, fmix32_, mix64, signed
from gapless.gpu_runner.sampling.logit_rules import LogitRules
from gapless.gpu_runner.sampling.logprobs import SampleOutput, sample_logprobs
from gapless.gpu_runner.sampling.nucleus import nucleus_argmax, top_p_cutoff
from gapless.gpu_runner.sampling.rejection import filtered_probs

# columns of the float parameter table
_TEMP, _TOP_P, _MIN_P, _PRES, _FREQ, _REP = range(6)
# columns of the int parameter table
_TOP_K, _SEED, _HAS_SEED, _NUM_PROMPT = range(4)


@dataclass(frozen=True)
class SamplingPaths:
    """Where a device samples faster another way than the plain torch one; its backend says
    (gpu_runner/cpu/sampling.py gives the cpu's)."""

    block_elements: int = 0  # rows sampled together: this // vocab (0: the whole batch)
    sort_free_top_p: bool = False  # top_p without top_k by rejection (sampling/nucleus.py)
    host_argmax: bool = False  # numpy's argmax over float32 rows on the host, not torch's max
    pinned_uploads: bool = False  # the parameter tables' copies leave pinned memory


@dataclass(frozen=True)
class BatchFlags:
    """Host-side facts about one batch that choose which sampling stages run."""

    all_greedy: bool
    any_greedy: bool
    any_penalty: bool  # repetition, presence or frequency penalty on some row
    max_top_k: int  # 0: no sampled row restricts top_k
    any_top_p: bool
    top_p_within_top_k: bool  # every sampled row with top_p also has top_k
    any_min_p: bool
    max_logprobs: int  # -1: no row asked; 0: sampled token only; k: also the top k
    # every row greedy, with no penalty, logprobs or logit rule that depends on the step: the
    # argmax (of the logits plus each row's constant rule, `biased`) is all there is
    plain: bool = False
    biased: bool = False


class SamplerState:
    """Per-slot sampling parameters and penalty counters, kept across steps (on `device`).

    Contract with the runner: `add` when a NewSlot arrives, `remove` for freed slots, `record`
    every token that enters a slot's sequence (prompt chunks and sampled tokens, each position
    once per slot lifetime; `sample` does not record its own output), `sample` per step.
    """

    def __init__(
        self,
        max_slots: int,
        vocab_size: int,
        device: torch.device | str,
        max_logprobs: int = 20,
        seed: int = 0,
        eos_token_ids: tuple[int, ...] = (),
        paths: SamplingPaths = SamplingPaths(),
    ) -> None:
        self.max_slots = max_slots
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.max_logprobs = max_logprobs
        self.paths = paths
        self._block_rows = max(paths.block_elements // vocab_size, 1) if paths.block_elements else 0
        self._argmax = _host_argmax if paths.host_argmax else _argmax
        self._fparams = np.zeros((max_slots, 6), np.float32)
        self._iparams = np.zeros((max_slots, 4), np.int64)
        self._num_logprobs = np.full(max_slots, -1, np.int64)  # -1: not asked
        self._active = np.zeros(max_slots, bool)
        self._has_penalty = np.zeros(max_slots, bool)
        self._dirty = False
        # flags() of the last batch, while no slot has come or gone since (see flags)
        self._flags: tuple[bytes, BatchFlags] | None = None
        self._fparams_dev = torch.zeros((max_slots, 6), dtype=torch.float32, device=self.device)
        self._iparams_dev = torch.zeros((max_slots, 4), dtype=torch.int64, device=self.device)
        # output token counts and prompt membership; one spare element at the end of the flat
        # prompt buffer absorbs writes for output positions, so record() needs no masking sync
        self._counts = torch.zeros((max_slots, vocab_size), dtype=torch.int32, device=self.device)
        self._prompt_flat = torch.zeros(
            max_slots * vocab_size + 1, dtype=torch.bool, device=self.device
        )
        self._prompt_seen = self._prompt_flat[:-1].view(max_slots, vocab_size)
        vocab = torch.arange(vocab_size, dtype=torch.int32, device=self.device)
        self._vocab_hash = fmix32_(vocab + signed(0x9E3779B9, 32))  # [V] int32
        gen = torch.Generator().manual_seed(seed)
        self._base_seed = int(torch.randint(-(2**62), 2**62, (1,), generator=gen))
        self._step = torch.zeros(1, dtype=torch.int64, device=self.device)  # sample() calls
        self.rules = LogitRules(max_slots, vocab_size, self.device, eos_token_ids)

    # ------------------------------------------------------------------ slot lifecycle

    def add(self, slot: int, params: SamplingParams, num_prompt_tokens: int) -> None:
        assert not self._active[slot], f"slot {slot} is already taken"
        top_k = params.top_k if 0 < params.top_k < self.vocab_size else 0
        self._fparams[slot] = (
            max(params.temperature, 0.0),
            params.top_p,
            params.min_p,
            params.presence_penalty,
            params.frequency_penalty,
            params.repetition_penalty,
        )
        seed = 0 if params.seed is None else signed(params.seed, 64)
        self._iparams[slot] = (top_k, seed, params.seed is not None, num_prompt_tokens)
        if params.logprobs is None:
            self._num_logprobs[slot] = -1
        else:
            self._num_logprobs[slot] = min(params.logprobs, self.max_logprobs)
        penalty = (
            params.repetition_penalty != 1.0
            or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
        )
        self._has_penalty[slot] = penalty
        self.rules.add(slot, params)
        self._active[slot] = True
        self._dirty = True
        self._flags = None
        if penalty:  # counters of slots without penalties are never read
            self._counts[slot].zero_()
            self._prompt_seen[slot].zero_()

    def remove(self, slot: int) -> None:
        assert self._active[slot], f"slot {slot} is not taken"
        self._active[slot] = False
        self._has_penalty[slot] = False
        self._num_logprobs[slot] = -1
        self.rules.remove(slot)
        self._flags = None

    def _push(self) -> None:
        """Upload the parameter tables if a slot changed since the last upload."""
        if not self._dirty:
            return
        for host, dev in ((self._fparams, self._fparams_dev), (self._iparams, self._iparams_dev)):
            src = torch.from_numpy(host.copy())
            if self.paths.pinned_uploads:
                src = src.pin_memory()  # why: a pinned source makes the copy truly async
            dev.copy_(src, non_blocking=True)
        self._dirty = False

    def _batch_index(self, host_slots: np.ndarray | list[int] | None) -> np.ndarray:
        if host_slots is None:
            return np.flatnonzero(self._active)
        index = np.asarray(host_slots, dtype=np.int64)
        assert self._active[index].all(), "sampling a slot that holds no request"
        return index

    def flags(self, host_slots: np.ndarray | list[int] | None = None) -> BatchFlags:
        """Flags over the given host-side slots (all active slots when None).

        why kept while the batch and its slots stay the same: a slot's parameters change only
        in add / remove, and the dozen numpy calls here are a measurable share of a batch-1
        step, with the caches cold after the forward (bench/RESULTS.md, "one stream's step")"""
        index = self._batch_index(host_slots)
        key = index.tobytes()
        if self._flags is not None and self._flags[0] == key:
            return self._flags[1]
        fp = self._fparams[index]
        greedy = fp[:, _TEMP] == 0.0
        sampled = ~greedy
        top_k = self._iparams[index, _TOP_K][sampled]
        top_p = fp[sampled, _TOP_P] < 1.0
        flags = BatchFlags(
            all_greedy=bool(greedy.all()),
            any_greedy=bool(greedy.any()),
            any_penalty=bool(self._has_penalty[index].any()),
            max_top_k=int(top_k.max(initial=0)),
            any_top_p=bool(top_p.any()),
            top_p_within_top_k=bool((top_k[top_p] > 0).all()),
            any_min_p=bool((fp[sampled, _MIN_P] > 0.0).any()),
            max_logprobs=int(self._num_logprobs[index].max(initial=-1)),
        )
        if flags.all_greedy and not flags.any_penalty and flags.max_logprobs < 0:
            plain = not self.rules.has_dynamic[index].any()
            biased = bool(self.rules.has_any[index].any())
            flags = dataclasses.replace(flags, plain=plain, biased=biased)
        self._flags = (key, flags)
        return flags

    # ------------------------------------------------------------------ per step

    def record(
        self,
        slots: torch.Tensor,
        positions: torch.Tensor,
        token_ids: torch.Tensor,
        host_slots: np.ndarray | list[int] | None = None,
    ) -> None:
        """Count tokens now in the sequences: slots, positions, token_ids [N] int64 on device.

        Positions below the slot's num_prompt_tokens are prompt (repetition penalty only); the
        rest are output, which is how a recomputed prefill after preemption stays correct.
        """
        index = self._batch_index(host_slots)
        if host_slots is not None:
            self.rules.record(index, slots, positions, token_ids)
        if not self._has_penalty[index].any():
            return
        self._push()
        flat = slots * self.vocab_size + token_ids  # [N] int64
        is_prompt = positions < self._iparams_dev[slots, _NUM_PROMPT]  # [N] bool
        spare = self._prompt_flat.numel() - 1
        self._prompt_flat.index_fill_(0, torch.where(is_prompt, flat, spare), True)
        self._counts.view(-1).index_add_(0, flat, (~is_prompt).to(torch.int32))

    def record_cached(self, slot: int, token_ids: list[int]) -> None:
        """Count the ids at positions 0.. of a slot whose KV came from the prefix cache."""
        n = len(token_ids)
        slots = torch.full((n,), slot, dtype=torch.int64, device=self.device)
        positions = torch.arange(n, dtype=torch.int64, device=self.device)
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        self.record(slots, positions, ids, [slot])

    def penalized_logits(self, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """logits [B, V] float32 after repetition, frequency and presence penalties."""
        self._push()
        fp = self._fparams_dev[slots]  # [B, 6] float32
        counts = self._counts[slots]  # [B, V] int32
        in_output = counts > 0
        seen = in_output | self._prompt_seen[slots]  # [B, V] bool
        rep = fp[:, _REP, None]  # [B, 1]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        return logits - fp[:, _FREQ, None] * counts - fp[:, _PRES, None] * in_output

    def draw_params(self, host_slots: np.ndarray) -> tuple[torch.Tensor, ...]:
        """Temperature, top_k, top_p, seed and has-seed [B] of the slots [B], on the host (what a
        draft model's drafts are drawn with: gpu_runner/draft_model.py)."""
        fp, ip = self._fparams[host_slots], self._iparams[host_slots]
        return (
            torch.from_numpy(fp[:, _TEMP].copy()),
            torch.from_numpy(ip[:, _TOP_K].copy()),
            torch.from_numpy(fp[:, _TOP_P].copy()),
            torch.from_numpy(ip[:, _SEED].copy()),
            torch.from_numpy(ip[:, _HAS_SEED] != 0),
        )

    def target_probs(
        self,
        logits: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        host_slots: np.ndarray,
    ) -> torch.Tensor:
        """[B, V] float32: the distribution sample() draws each row from (logit rules,
        penalties, temperature, top_k, top_p, min_p), for rejection sampling a draft model's
        drafts. Arguments as sample()'s; logits are not changed."""
        self._push()
        num_prompt = self._iparams_dev[slots, _NUM_PROMPT]
        x = self.rules.apply(logits.float(), host_slots, positions, num_prompt, False)
        if self._has_penalty[host_slots].any():
            x = self.penalized_logits(x, slots)
        fp, ip = self._fparams_dev[slots], self._iparams_dev[slots]
        flags = self.flags(host_slots)
        probs = filtered_probs(
            x, fp[:, _TEMP], ip[:, _TOP_K], fp[:, _TOP_P], flags.max_top_k > 0, flags.any_top_p
        )
        floor = fp[:, _MIN_P, None] * probs.amax(dim=-1, keepdim=True)  # [B, 1]
        probs = probs.masked_fill(probs < floor, 0.0)
        return probs / probs.sum(dim=-1, keepdim=True)

    def sample(
        self,
        logits: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        host_slots: np.ndarray | list[int] | None = None,
        constrain: Callable[[torch.Tensor, bool], torch.Tensor] | None = None,
    ) -> SampleOutput:
        """One token per row. logits [B, V]; slots, positions [B] int64 on device.
        constrain(x, inplace) (the grammar masks) limits the logits sampled from, as the logit
        rules do; logprobs stay the model's (so the raw logits are changed in place only when
        no row asks for logprobs: a [B, V] copy per step is what the other rows would pay).

        positions holds the position the new token will take (its sequence length so far);
        seeded rows hash (seed, position), so a recomputed request repeats its tokens.
        host_slots, the same slots on the host, scopes the stage flags to this batch; without
        it the flags cover every active slot (correct, sometimes slower).
        """
        self._push()
        flags = self.flags(host_slots)
        if flags.plain and constrain is None:
            # why a path of its own: one stream's steps are mostly this (clients that ignore
            # EOS ban it with a bias), and each call skipped below costs with the caches cold
            # after the forward (bench/RESULTS.md, "the int4 layers' single row through a VNNI
            # kernel")
            self._step.add_(1)
            x = logits.float()  # in place below, as rules.apply: no row asked for logprobs
            if flags.biased and host_slots is not None:
                self.rules.apply_static(x, np.asarray(host_slots))
            return sample_logprobs(logits, self._argmax(x), -1, plain=True)
        logits = logits.float()
        adjusted = logits
        inplace = flags.max_logprobs < 0
        if host_slots is not None:
            num_prompt = self._iparams_dev[slots, _NUM_PROMPT]
            host = np.asarray(host_slots)
            adjusted = self.rules.apply(logits, host, positions, num_prompt, inplace)
        if constrain is not None:
            adjusted = constrain(adjusted, inplace or adjusted is not logits)
        step = self._step.add_(1)  # [1] int64; in place so graph replays advance it
        batch = logits.shape[0]
        rows = self._block_rows or batch
        greedy_only = flags.all_greedy and not flags.any_penalty and flags.max_logprobs < 0
        if batch <= max(rows, 1) or greedy_only:  # why: an argmax makes no temporaries
            return self._sample_rows(logits, adjusted, slots, positions, step, 0, flags)
        # why: where the device has caches (a cpu), [rows, V] temporaries that fit in them beat
        # [B, V] ones
        parts = [
            self._sample_rows(
                logits[i : i + rows],
                adjusted[i : i + rows],
                slots[i : i + rows],
                positions[i : i + rows],
                step,
                i,
                flags,
            )
            for i in range(0, batch, rows)
        ]
        return SampleOutput(
            torch.cat([p.token_ids for p in parts]),
            None if parts[0].logprobs is None else torch.cat([p.logprobs for p in parts]),
            torch.cat([p.top_ids for p in parts]),
            torch.cat([p.top_logprobs for p in parts]),
        )

    def _sample_rows(
        self,
        logits: torch.Tensor,
        adjusted: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        step: torch.Tensor,
        row0: int,
        flags: BatchFlags,
    ) -> SampleOutput:
        """sample() over rows row0.. of the batch; rows are independent of each other.
        Sampling reads `adjusted` (the request's logit rules applied); logprobs read `logits`."""
        x = self.penalized_logits(adjusted, slots) if flags.any_penalty else adjusted
        if flags.all_greedy:
            token_ids = self._argmax(x)
        else:
            token_ids = self._draw(x, slots, positions, step, row0, flags)
            if flags.any_greedy:
                greedy = self._fparams_dev[slots, _TEMP] == 0.0  # [B] bool
                token_ids = torch.where(greedy, self._argmax(x), token_ids)
        return sample_logprobs(logits, token_ids, flags.max_logprobs)

    def _draw(
        self,
        x: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        step: torch.Tensor,
        row0: int,
        flags: BatchFlags,
    ) -> torch.Tensor:
        """argmax(probs / q), q ~ Exp(1): an exact draw from probs, which need no renormalizing."""
        fp = self._fparams_dev[slots]  # [B, 6] float32
        ip = self._iparams_dev[slots]  # [B, 4] int64
        temp = fp[:, _TEMP]
        x = x / torch.where(temp > 0.0, temp, 1.0)[:, None]  # [B, V] float32
        top_p = fp[:, _TOP_P]
        if flags.max_top_k:
            top_k = ip[:, _TOP_K]  # [B], 0 disables
            kth = x.topk(flags.max_top_k, dim=-1, sorted=True).values  # [B, K] descending
            cutoff = kth.gather(1, (top_k.clamp(1, flags.max_top_k) - 1)[:, None])  # [B, 1]
            cutoff = torch.where(top_k[:, None] > 0, cutoff, -torch.inf)
            if flags.any_top_p and flags.top_p_within_top_k:
                # why: every top_p row also has top_k, so its nucleus lies among the K sorted
                # candidates and no full-vocab sort is needed
                kth = kth.masked_fill(kth < cutoff, -torch.inf)
                cutoff = torch.maximum(cutoff, top_p_cutoff(kth, torch.softmax(kth, -1), top_p))
            x = x.masked_fill(x < cutoff, -torch.inf)
        probs = torch.softmax(x, dim=-1)  # [B, V] float32
        nucleus = flags.any_top_p and not flags.top_p_within_top_k
        sort_free = nucleus and self.paths.sort_free_top_p
        nucleus_probs = probs  # [B, V] what top_p measures: after top_k, before min_p
        if nucleus and not sort_free:
            ordered = probs.sort(dim=-1, descending=True).values  # [B, V]
            probs = probs.masked_fill(probs < top_p_cutoff(ordered, ordered, top_p), 0.0)
        if flags.any_min_p:
            floor = fp[:, _MIN_P, None] * probs.amax(dim=-1, keepdim=True)  # [B, 1]
            probs = probs.masked_fill(probs < floor, 0.0)
        seeded_key = mix64(mix64(ip[:, _SEED]) ^ positions)  # [B] int64
        rows = torch.arange(row0, row0 + x.shape[0], device=x.device)
        free_key = mix64(mix64(step + (self._base_seed ^ UNSEEDED_SALT)) ^ rows)
        keys = torch.where(ip[:, _HAS_SEED] != 0, seeded_key, free_key)  # [B] int64
        if sort_free:
            ratio = probs.div(exponentials(keys, self._vocab_hash))  # [B, V]
            return nucleus_argmax(ratio, nucleus_probs, top_p)
        return self._argmax(probs.div_(exponentials(keys, self._vocab_hash)))


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """x [B, V] -> [B] int64, the first index of each row's max (max's kernel: faster than
    argmax's)."""
    return x.max(dim=-1).indices


def _host_argmax(x: torch.Tensor) -> torch.Tensor:
    """_argmax of x on the host, by numpy where x is float32."""
    if x.dtype == torch.float32:
        return torch.from_numpy(np.argmax(x.numpy(), axis=-1))
    return x.max(dim=-1).indices
