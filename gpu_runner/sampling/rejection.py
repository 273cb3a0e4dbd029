"""Rejection sampling of a draft model's proposals: the output keeps the target's distribution.

A draft model proposes d_1..d_k, each drawn from its distribution q_i; the target gives p_i at
the same positions (and p_{k+1} after the last). Both are the distributions the sampler draws
from: the request's temperature, top_k and top_p applied to each model's logits
(`filtered_probs`), so the rules hold on the output as they do without drafts. Position i
accepts d_i with probability min(1, p_i(d_i) / q_i(d_i)); the first rejection ends the run
with a token drawn from the residual max(p_i - q_i, 0) (normalized), and a run that accepts
all k ends with a token drawn from p_{k+1}. Each output token is then distributed as p at its
position (Leviathan et al., 2023; Chen et al., 2023). Greedy rows need nothing apart: p and q
are one-hot, so a draft is accepted iff it is the target's argmax.

Tensors are batched over rows; nothing here reads the device on the host.
"""

from __future__ import annotations

import torch

from gapless.gpu_runner.sampling.nucleus import top_p_cutoff


def filtered_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    any_top_k: bool = True,
    any_top_p: bool = True,
) -> torch.Tensor:
    """[B, V] the distribution a row samples from: logits [B, V] / temperature [B] (0: the
    argmax, one-hot), the top_k [B] (0: all) highest kept (ties at the k-th kept too), then
    the top_p [B] nucleus of what is left (the shortest run of the likeliest tokens whose
    mass reaches top_p; 1: all), renormalized. The sampler's rules, in its order.
    any_top_k, any_top_p False: the caller knows no row has one (its [B, V] sort is skipped)."""
    greedy = temperature <= 0
    x = logits / torch.where(greedy, 1.0, temperature)[:, None]
    vocab = x.shape[-1]
    if any_top_k:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)  # [B]
        ordered = x.sort(dim=-1, descending=True).values  # [B, V]
        kth = ordered.gather(1, (k - 1)[:, None])  # [B, 1]
        x = x.masked_fill(x < kth, -torch.inf)
    probs = torch.softmax(x, dim=-1)
    if any_top_p:
        ordered_probs = probs.sort(dim=-1, descending=True).values
        probs = probs.masked_fill(probs < top_p_cutoff(ordered_probs, ordered_probs, top_p), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[..., V] max(p - q, 0) normalized: what a rejected position draws from. Where p <= q
    everywhere (p == q: no draft is ever rejected there) it is p itself."""
    r = (p - q).clamp_(min=0)
    total = r.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=torch.finfo(r.dtype).tiny), p)


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[B] int64: token j with probability probs[b, j] / sum(probs[b]), by inverse CDF of the
    uniforms u [B] in [0, 1)."""
    cdf = probs.cumsum(dim=-1)  # [B, V]
    at = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True)
    return at.squeeze(1).clamp_(max=probs.shape[-1] - 1)


def rejection_sample(
    p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, u: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """p [B, k + 1, V] target and q [B, k, V] draft distributions (filtered_probs), drafts
    [B, k] int64 drawn from q, u [B, k] and v [B] uniforms in [0, 1). Returns tokens
    [B, k + 1] (row b's first counts[b] are its output; -1 after) and counts [B] int64 (the
    accepted drafts, plus one)."""
    batch, k = drafts.shape
    px = p[:, :k].gather(2, drafts[..., None]).squeeze(2)  # [B, k]
    qx = q.gather(2, drafts[..., None]).squeeze(2)  # [B, k]
    accept = u * qx < px  # [B, k]: probability min(1, px / qx) over u
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B]
    rows = torch.arange(batch, device=p.device)
    at = num_accepted.clamp(max=max(k - 1, 0))
    ended = num_accepted < k  # [B] a rejection ended the run
    target = p[rows, num_accepted]  # [B, V] p at the position the last token takes
    last = residual(target, q[rows, at]) if k else target
    last = torch.where(ended[:, None], last, target)
    tokens = torch.full((batch, k + 1), -1, dtype=torch.long, device=p.device)
    positions = torch.arange(k + 1, device=p.device)[None, :]
    tokens[:, :k] = torch.where(positions[:, :k] < num_accepted[:, None], drafts, -1)
    tokens[rows, num_accepted] = draw(last, v)
    return tokens, num_accepted + 1
