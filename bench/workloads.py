"""Workloads: fixed IN:OUT synthetic prompts, ShareGPT (file or synthetic mix), LooGLE-like QA."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from gapless.bench.datasets import read_loogle, read_sharegpt
from gapless.bench.prompts import PromptMaker

if TYPE_CHECKING:
    from gapless.bench.tenants import TenantSpec

SHAREGPT_MEAN = (200.0, 180.0)  # synthetic mix: mean prompt and output tokens
LOOGLE_MEAN_PROMPT, LOOGLE_MEAN_OUTPUT = 6000.0, 50.0


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int  # tokens, as the server counts them
    output_len: int  # max_tokens sent
    tenant: str | None = None  # sent as X-Tenant and `user`
    priority: int | str | None = None  # sent as `priority` when set
    arrival_s: float | None = None  # s after the start; None: the run's rate decides


@dataclass(frozen=True)
class Workload:
    name: str  # "1024:64", "sharegpt", "sharegpt-synthetic", "loogle", "loogle-synthetic"
    requests: tuple[BenchRequest, ...]
    synthetic: bool  # made up here rather than read from a dataset
    tenants: tuple[TenantSpec, ...] = ()  # who sends the requests (a multi-tenant run)

    @property
    def mean_prompt_len(self) -> float:
        return float(np.mean([r.prompt_len for r in self.requests]))

    @property
    def mean_output_len(self) -> float:
        return float(np.mean([r.output_len for r in self.requests]))


def parse_fixed(spec: str) -> tuple[int, int] | None:
    """(IN, OUT) of an `IN:OUT` spec, None for a named workload."""
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", spec)
    if m is None:
        return None
    num_in, num_out = int(m.group(1)), int(m.group(2))
    if num_in < 2 or num_out < 1:
        raise ValueError(f"workload {spec!r}: IN must be at least 2 and OUT at least 1")
    return num_in, num_out


def is_known(spec: str) -> bool:
    return spec in ("sharegpt", "loogle") or parse_fixed(spec) is not None


def build_workload(
    spec: str,
    maker: PromptMaker,
    *,
    num_requests: int,
    seed: int = 0,
    dataset: str | Path | None = None,
    max_model_len: int | None = None,
) -> Workload:
    """`num_requests` requests of the workload; the same seed gives the same requests."""
    rng = np.random.default_rng(seed)
    fixed = parse_fixed(spec)
    if fixed is not None:
        num_in, num_out = fixed
        prompts = maker.make_many([num_in] * num_requests, rng)
        reqs = [BenchRequest(p, num_in, num_out) for p in prompts]
        return Workload(spec, tuple(reqs), synthetic=True)
    if spec == "sharegpt":
        if dataset is not None:
            return _from_pairs(
                "sharegpt", read_sharegpt(dataset), maker, num_requests, rng, max_model_len
            )
        return _sharegpt_synthetic(maker, num_requests, rng, max_model_len)
    if spec == "loogle":
        if dataset is not None:
            return _from_pairs(
                "loogle", read_loogle(dataset), maker, num_requests, rng, max_model_len
            )
        return _loogle_synthetic(maker, num_requests, rng, max_model_len)
    raise ValueError(f"unknown workload {spec!r}: use IN:OUT (e.g. 1024:64), sharegpt or loogle")


def lognormal_lengths(
    rng: np.random.Generator, mean: float, sigma: float, n: int, low: int, high: int
) -> np.ndarray:
    """Integer lengths, lognormal with the given mean before clipping to [low, high]."""
    mu = np.log(mean) - sigma**2 / 2
    return np.clip(np.rint(rng.lognormal(mu, sigma, size=n)), low, high).astype(int)


def _sharegpt_synthetic(
    maker: PromptMaker, n: int, rng: np.random.Generator, cap: int | None
) -> Workload:
    prompt_lens = lognormal_lengths(rng, SHAREGPT_MEAN[0], 0.8, n, 4, 2048)
    output_lens = lognormal_lengths(rng, SHAREGPT_MEAN[1], 0.8, n, 4, 1024)
    if cap is not None:
        output_lens = np.where(
            prompt_lens + output_lens > cap, np.minimum(output_lens, cap // 2), output_lens
        )
        prompt_lens = np.minimum(prompt_lens, cap - output_lens)
    prompts = maker.make_many(prompt_lens.tolist(), rng)
    reqs = [
        BenchRequest(p, n_in, n_out)
        for p, n_in, n_out in zip(prompts, prompt_lens.tolist(), output_lens.tolist(), strict=True)
    ]
    return Workload("sharegpt-synthetic", tuple(reqs), synthetic=True)


def _loogle_synthetic(
    maker: PromptMaker, n: int, rng: np.random.Generator, cap: int | None
) -> Workload:
    prompt_lens = lognormal_lengths(rng, LOOGLE_MEAN_PROMPT, 0.4, n, 2000, 16000)
    output_lens = np.clip(np.rint(rng.normal(LOOGLE_MEAN_OUTPUT, 12, size=n)), 16, 100).astype(int)
    if cap is not None:
        prompt_lens = np.minimum(prompt_lens, cap - output_lens)
    topics = rng.integers(0, len(maker.words), size=n)
    suffixes = [
        f"\n\nQuestion: What does the document above say about the {maker.words[t]}?\nAnswer:"
        for t in topics
    ]
    prompts = maker.make_many(prompt_lens.tolist(), rng, suffixes)
    reqs = [
        BenchRequest(p, n_in, n_out)
        for p, n_in, n_out in zip(prompts, prompt_lens.tolist(), output_lens.tolist(), strict=True)
    ]
    return Workload("loogle-synthetic", tuple(reqs), synthetic=True)


def _from_pairs(
    name: str,
    pairs: list[tuple[str, str]],
    maker: PromptMaker,
    n: int,
    rng: np.random.Generator,
    cap: int | None,
) -> Workload:
    """Requests sampled from (prompt, answer) pairs; the answer's length is the output length."""
    order = rng.permutation(len(pairs)) if n <= len(pairs) else rng.integers(0, len(pairs), n)
    reqs = []
    for i in order:
        if len(reqs) == n:
            break
        prompt, answer = pairs[int(i)]
        num_out = maker.count(answer) - maker.num_special
        if num_out < 4:
            continue
        if name == "loogle" and cap is not None:
            prompt = maker.truncate(prompt, cap - num_out)
        num_in = maker.count(prompt)
        if num_in < 4 or (cap is not None and num_in + num_out > cap):
            continue
        reqs.append(BenchRequest(prompt, num_in, num_out))
    if not reqs:
        raise ValueError(f"no usable {name} records (prompt and answer of at least 4 tokens)")
    while len(reqs) < n:  # a small dataset repeats
        reqs.append(reqs[int(rng.integers(len(reqs)))])
    return Workload(name, tuple(reqs), synthetic=False)
