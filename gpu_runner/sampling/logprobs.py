"""A step's logprobs as per-row entries: each sampled row carries its own, so no process
re-indexes flat arrays."""

from __future__ import annotations

import numpy as np

from gapless.common.messages import SampleLogprobs


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
