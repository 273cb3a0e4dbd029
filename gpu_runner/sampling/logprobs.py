"""A step's logprobs as per-row entries: each sampled row carries its own, so no process
re-indexes flat arrays."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gapless.common.messages import SampleLogprobs


@dataclass(frozen=True)
class SampleOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32, raw model log-softmax; None if nobody asked
    top_ids: torch.Tensor  # [B, K] int64, K = max requested top logprobs in the batch (may be 0)
    top_logprobs: torch.Tensor  # [B, K] float32, sorted descending per row
    plain: bool = False  # the batch's flags were plain: nothing for record() to count
    # a verify (gpu_runner/verify.py): token_ids are each entry's run, counts[j] long
    counts: np.ndarray | None = None  # [E_s] int64 accepted drafts + 1 per sampling entry
    num_drafted: np.ndarray | None = None  # [E_s] int64 drafts each entry verified


def row_logprobs(asks: np.ndarray, logprobs, top_ids, top_logprobs) -> list[SampleLogprobs | None]:
    """asks [B_s] int64: top entries each sampled row asked for (-1: no logprobs);
    logprobs [B_s]; top_ids, top_logprobs [B_s, K], K >= asks.max(), best first (numpy or torch
    on the host)."""
    lps = logprobs.tolist()
    out: list[SampleLogprobs | None] = [None] * len(lps)
    for j in np.flatnonzero(asks >= 0).tolist():
        k = int(asks[j])
        out[j] = SampleLogprobs(lps[j], top_ids[j, :k].tolist(), top_logprobs[j, :k].tolist())
    return out


def sample_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, max_logprobs: int, plain: bool = False
) -> SampleOutput:
    """Raw model logprobs of the chosen tokens and the top max_logprobs ids (-1: none asked);
    `plain` marks the output of a plain batch (SampleOutput.plain)."""
    batch = logits.shape[0]
    if max_logprobs < 0:
        empty_ids = torch.empty((batch, 0), dtype=torch.int64, device=logits.device)
        empty = torch.empty((batch, 0), dtype=torch.float32, device=logits.device)
        return SampleOutput(token_ids, None, empty_ids, empty, plain=plain)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [B, 1]
    logprobs = (logits.gather(1, token_ids[:, None]) - lse).squeeze(1)  # [B]
    top_vals, top_ids = logits.topk(max_logprobs, dim=-1, sorted=True)  # [B, K]
    return SampleOutput(token_ids, logprobs, top_ids, top_vals - lse)
