"""Exact verification of drafted tokens: the output equals speculation off, token for token.

Entry j of a step with drafts fed its last token and d_j drafts and has 1 + d_j rows of
logits. Round r samples row r of every entry still going, through the same sampler call a
step without drafts makes (logit rules, penalties, min_tokens, the counter-based draw of
(seed, position, token)); the sampled token is recorded like any output, so round r + 1 sees
the penalty, bad-words and min_tokens state as if the drafts before it were accepted. An entry
goes on while its sampled token equals its draft; the first token that differs (or the one
after the last draft) ends its run. Seeded and greedy rows draw exactly what speculation off
draws; unseeded ones draw from the same distribution with fresh randomness, as any step does.
Constrained rows never draft (the core gives them none), so the grammar sees round 0 only.

A draft model's sampled rows (`ex.draft_q[slot]` holds q [d, V] of the slot's drafts) are verified by
rejection sampling instead, round by round with the same recorded state: the target's p is
the distribution the sampler draws from, and the round's token is the draft when
u * q(draft) < p(draft), else a draw from max(p - q, 0); the token after the last draft is the
sampler's own draw. Their greedy rows need nothing apart (the argmax is exact).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from gapless.gpu_runner.batch import StepInputs
from gapless.gpu_runner.draft_model import ACCEPT_SALT, RESIDUAL_SALT, uniforms
from gapless.gpu_runner.sampling.logprobs import SampleOutput, sample_logprobs
from gapless.gpu_runner.sampling.rejection import draw, residual

if TYPE_CHECKING:
    from gapless.gpu_runner.executor import StepExecutor


def verify(
    ex: StepExecutor,
    inp: StepInputs,
    logits: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
) -> SampleOutput:
    """logits [B_s, V], slots and positions [B_s] on the device, B_s = sum of counts; returns
    each entry's run (accepted drafts, then the token sampled after them), entry by entry."""
    assert inp.sample_counts is not None and inp.sample_drafts is not None
    counts, drafts, entry_slots = inp.sample_counts, inp.sample_drafts, inp.entry_slots_host
    assert entry_slots is not None
    first = np.cumsum(counts) - counts  # [E] each entry's first logit row
    host = inp.sample_slots_host
    going = np.arange(len(counts))
    rounds: list[tuple[np.ndarray, int, SampleOutput]] = []
    accepted = np.zeros(len(counts), np.int64)
    for r in range(int(counts.max())):
        rows_host = first[going] + r
        rows = torch.from_numpy(rows_host).to(logits.device)
        round_host = host[rows_host]
        constrain = None
        if r == 0 and ex.grammar.any_in(round_host):
            constrain = partial(_constrain, ex, round_host)
        s, p = slots[rows], positions[rows]
        out = ex.sampler.sample(logits[rows], s, p, round_host, constrain)
        if ex.draft_q:
            out = _reject(ex, going, r, inp, logits[rows], s, p, round_host, out)
        if not out.plain:
            ex.sampler.record(s, p, out.token_ids, round_host)
            ex.grammar.remember(round_host, out.token_ids)
        rounds.append((going, r, out))
        tokens = out.token_ids.tolist()
        nxt = [
            j
            for j, t in zip(going.tolist(), tokens, strict=True)
            if r < counts[j] - 1 and t == drafts[j][r]
        ]
        if not nxt:
            break
        going = np.asarray(nxt, np.int64)
        accepted[going] += 1
    run = accepted + 1  # [E] tokens each entry yields
    at = np.cumsum(run) - run
    out = _gather(rounds, at, int(run.sum()), logits.device)
    ends = torch.from_numpy(entry_slots).to(logits.device)
    ex.batch.last_token[ends] = out.token_ids[torch.from_numpy(at + run - 1).to(logits.device)]
    ex.batch.length[entry_slots] -= counts - run  # rejected drafts' positions are written again
    if ex.drafts.any_in(entry_slots):
        ids = out.token_ids.tolist()
        for j, slot in enumerate(entry_slots.tolist()):
            if ex.drafts.active[slot]:
                ex.drafts.sampled(slot, ids[at[j] : at[j] + run[j]])
    return SampleOutput(
        out.token_ids, out.logprobs, out.top_ids, out.top_logprobs, False, run, counts - 1
    )


def _reject(
    ex: StepExecutor,
    going: np.ndarray,
    r: int,
    inp: StepInputs,
    logits: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    host: np.ndarray,
    out: SampleOutput,
) -> SampleOutput:
    """Round r's tokens with a draft model's sampled rows decided by rejection sampling: the
    draft kept with probability min(1, p/q), else a draw from the residual. Their token at
    the position after the last draft is the sampler's draw from p, as any row's. logits
    [G, V], slots, positions [G] and host [G] are the round's rows (entries `going`)."""
    assert inp.sample_counts is not None and inp.sample_drafts is not None
    counts, drafts = inp.sample_counts, inp.sample_drafts
    picked = [
        row
        for row, j in enumerate(going.tolist())
        if r < counts[j] - 1 and int(host[row]) in ex.draft_q
    ]
    if not picked:
        return out
    idx = torch.tensor(picked, dtype=torch.long, device=logits.device)
    p = ex.sampler.target_probs(logits[idx], slots[idx], positions[idx], host[picked])
    q = torch.stack([ex.draft_q[int(host[row])][r] for row in picked]).to(p.device)  # [P, V]
    d = torch.tensor([drafts[j][r] for j in going[picked].tolist()], device=p.device)  # [P]
    _, _, _, seed, has_seed = ex.sampler.draw_params(host[picked])
    keys = torch.where(has_seed, seed, torch.randint(-(2**62), 2**62, seed.shape))
    pos = positions[idx].cpu()
    u = uniforms(keys, pos, ACCEPT_SALT).to(p.device)
    px, qx = p.gather(1, d[:, None]).squeeze(1), q.gather(1, d[:, None]).squeeze(1)
    redraw = draw(residual(p, q), uniforms(keys, pos, RESIDUAL_SALT).to(p.device))
    token_ids = out.token_ids.clone()
    token_ids[idx] = torch.where(u * qx < px, d, redraw)
    asked = ex.sampler.flags(host).max_logprobs
    return dataclasses.replace(sample_logprobs(logits.float(), token_ids, asked), plain=out.plain)


def _constrain(ex: StepExecutor, host: np.ndarray, x: torch.Tensor, inplace: bool):
    return ex.grammar.apply(x, host, inplace)


def _gather(
    rounds: list[tuple[np.ndarray, int, SampleOutput]], at: np.ndarray, n: int, device
) -> SampleOutput:
    """The rounds' samples placed entry by entry: entry j's round r goes to at[j] + r."""
    token_ids = torch.empty(n, dtype=torch.long, device=device)
    width = max(out.top_ids.shape[1] for _, _, out in rounds)
    with_lp = any(out.logprobs is not None for _, _, out in rounds)
    logprobs = torch.zeros(n, device=device) if with_lp else None
    top_ids = torch.zeros((n, width), dtype=torch.long, device=device)
    top_lps = torch.zeros((n, width), device=device)
    for going, r, out in rounds:
        dest = torch.from_numpy(at[going] + r).to(device)
        token_ids[dest] = out.token_ids
        if logprobs is not None and out.logprobs is not None:
            logprobs[dest] = out.logprobs.float()
        k = out.top_ids.shape[1]
        if k:
            top_ids[dest, :k] = out.top_ids
            top_lps[dest, :k] = out.top_logprobs.float()
    return SampleOutput(token_ids, logprobs, top_ids, top_lps)
