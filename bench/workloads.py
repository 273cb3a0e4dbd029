"""Workloads: fixed IN:OUT synthetic prompts, ShareGPT (file or synthetic mix), LooGLE-like QA,
a shared system prompt with unique questions (`prefix`), multi-turn chat sessions (`chat`)."""

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
    # a turn of a chat session: sent after the session's previous turn answered (and the
    # think time), its prompt the session's history so far, then this prompt
    session: int | None = None


@dataclass(frozen=True)
class Workload:
    name: str  # "1024:64", "sharegpt", "sharegpt-synthetic", "loogle", "loogle-synthetic"
    requests: tuple[BenchRequest, ...]
    synthetic: bool  # made up here rather than read from a dataset
    tenants: tuple[TenantSpec, ...] = ()  # who sends the requests (a multi-tenant run)
    think_s: float = 0.0  # a chat session's pause between an answer and its next turn

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


def _length(text: str, what: str) -> tuple[int, int]:
    """N or LO-HI, as (LO, HI)."""
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", text)
    if m is None:
        raise ValueError(f"{what} must be N or LO-HI, got {text!r}")
    low = int(m.group(1))
    high = int(m.group(2)) if m.group(2) else low
    if not 1 <= low <= high:
        raise ValueError(f"{what} must be at least 1 and LO <= HI, got {text!r}")
    return low, high


def parse_prefix(spec: str) -> tuple[int, tuple[int, int], int] | None:
    """(S, (QLO, QHI), OUT) of `prefix:S:Q:OUT` (Q is N or LO-HI), None for another spec."""
    parts = spec.split(":")
    if parts[0] != "prefix":
        return None
    if len(parts) != 4:
        raise ValueError(f"workload {spec!r}: use prefix:S:Q:OUT, e.g. prefix:1024:32-128:64")
    shared = _length(parts[1], "S")[0]
    return shared, _length(parts[2], "Q"), _length(parts[3], "OUT")[0]


def parse_chat(spec: str) -> tuple[int, int, int, int, float] | None:
    """(SESSIONS, TURNS, USER, OUT, THINK) of `chat:SESSIONS:TURNS:USER:OUT[:THINK]`."""
    parts = spec.split(":")
    if parts[0] != "chat":
        return None
    if len(parts) not in (5, 6):
        raise ValueError(
            f"workload {spec!r}: use chat:SESSIONS:TURNS:USER:OUT[:THINK_S], e.g. chat:32:4:64:64:1"
        )
    names = ("SESSIONS", "TURNS", "USER", "OUT")
    nums = [_length(p, name)[0] for p, name in zip(parts[1:5], names, strict=True)]
    think = float(parts[5]) if len(parts) == 6 else 0.0
    if not think >= 0:
        raise ValueError(f"workload {spec!r}: THINK_S must be 0 or more")
    return nums[0], nums[1], nums[2], nums[3], think


def is_known(spec: str) -> bool:
    try:
        special = parse_prefix(spec) is not None or parse_chat(spec) is not None
        return spec in ("sharegpt", "loogle") or special or parse_fixed(spec) is not None
    except ValueError:
        return False


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
    prefix = parse_prefix(spec)
    if prefix is not None:
        return _prefix(spec, prefix, maker, num_requests, rng)
    chat = parse_chat(spec)
    if chat is not None:
        return _chat(spec, chat, maker, rng)
    raise ValueError(
        f"unknown workload {spec!r}: use IN:OUT (e.g. 1024:64), sharegpt, loogle, "
        "prefix:S:Q:OUT or chat:SESSIONS:TURNS:USER:OUT[:THINK_S]"
    )


def _prefix(spec, shape, maker: PromptMaker, n: int, rng: np.random.Generator) -> Workload:
    """One system prompt of S tokens, then a question of its own for every request."""
    shared, (q_low, q_high), out = shape
    system = maker.make(shared, rng)
    q_lens = rng.integers(q_low, q_high + 1, size=n).tolist()
    # why no special tokens in the question: the system prompt holds the BOS if any
    questions = maker.make_many([q + maker.num_special for q in q_lens], rng)
    prompts = [f"{system} {q}" for q in questions]
    counts = maker.count_many(prompts)
    reqs = [BenchRequest(p, c, out) for p, c in zip(prompts, counts, strict=True)]
    return Workload(spec, tuple(reqs), synthetic=True)


def _chat(spec, shape, maker: PromptMaker, rng: np.random.Generator) -> Workload:
    """SESSIONS sessions of TURNS user messages; the load generator sends each turn with the
    session's history in front (see loadgen.run_sessions), so prompt lengths grow by turn."""
    sessions, turns, user, out, think = shape
    messages = maker.make_many([user + maker.num_special] * (sessions * turns), rng)
    reqs = [
        BenchRequest(messages[s * turns + t], user, out, session=s)
        for s in range(sessions)
        for t in range(turns)
    ]
    return Workload(spec, tuple(reqs), synthetic=True, think_s=think)


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
