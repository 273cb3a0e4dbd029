"""Nucleus (top_p) sampling without a sort, for the exponential race of the sampler.

The sampler draws argmax(probs / q) with q ~ Exp(1) over the tokens a row keeps. For top_p the
kept set is the nucleus: the shortest run of the most likely tokens whose mass reaches top_p,
which a sort finds at the cost of sorting the whole vocabulary per row (on cpu, slower than
the forward). Here the race is run over a shrinking superset of the nucleus instead:

1. w = argmax(probs / q) over every candidate (tokens outside the nucleus included);
2. w is in the nucleus iff the mass of the tokens strictly more likely than w is below top_p:
   one masked sum over the row;
3. if it is not, no token as likely as w or less is in the nucleus: drop them and go to 1.

The race over a subset with the same q is the race the sort-based filter runs, and the winner
over a superset that lies in the subset wins the subset too, so the token is the one the
sort-based filter gives, not only one with the same distribution. A row usually ends at once
(its draw lands in the nucleus with probability about top_p), and each pass over the
rejected rows drops at least the token that won.
"""

from __future__ import annotations

import torch


def mass_above(probs: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """[B] float32: the mass of the tokens more likely than token_ids [B] in probs [B, V]."""
    own = probs.gather(1, token_ids[:, None])  # [B, 1]
    return probs.masked_fill(probs <= own, 0.0).sum(dim=-1)


def nucleus_argmax(ratio: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[B] int64: argmax of ratio [B, V] over each row's top_p nucleus of probs [B, V].

    ratio is probs / q with the tokens other filters removed at 0; top_p [B] float32, rows
    with top_p >= 1 keep every token. The loop reads each pass's outcome on the host: meant
    for the cpu, where that costs nothing (cuda keeps the sort, which costs little there).
    """
    token_ids = ratio.max(dim=-1).indices  # [B] int64
    rejected = (mass_above(probs, token_ids) >= top_p) & (top_p < 1.0)  # [B] bool
    if not bool(rejected.any()):
        return token_ids
    rows = rejected.nonzero().squeeze(1)  # [R] the rows whose draw left the nucleus
    r, p, tp, win = ratio[rows], probs[rows], top_p[rows], token_ids[rows]
    while rows.numel():
        r.masked_fill_(p <= p.gather(1, win[:, None]), 0.0)  # [R, V]
        win = r.max(dim=-1).indices  # [R]
        token_ids[rows] = win
        # why the second test: a winner at 0 means nothing is left (nan logits), not a loop
        again = (mass_above(p, win) >= tp) & (r.gather(1, win[:, None]).squeeze(1) > 0)
        rows, r, p, tp, win = rows[again], r[again], p[again], tp[again], win[again]
    return token_ids


def top_p_cutoff(
    ordered: torch.Tensor, ordered_probs: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """[B, 1] smallest value of `ordered` inside the nucleus: the shortest prefix whose mass
    reaches top_p. ordered [B, N] sorted descending, ordered_probs [B, N] their probs, top_p [B].

    Rows with top_p >= 1 get -inf: a float32 cumsum can reach 1 early and would cut a tail
    that should stay.
    """
    before = ordered_probs.cumsum(dim=-1) - ordered_probs  # [B, N] mass ahead of each entry
    num_kept = (before < top_p[:, None]).sum(dim=-1, keepdim=True)  # [B, 1], >= 1
    cutoff = ordered.gather(1, num_kept - 1)  # [B, 1]
    return torch.where(top_p[:, None] < 1.0, cutoff, -torch.inf)
