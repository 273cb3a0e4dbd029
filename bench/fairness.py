"""Per-tenant results of a multi-tenant run: latency, tokens received over time, and Jain's
fairness index over the window in which every tenant was backlogged.

All times are seconds after the run's start (the client's clock); a token is counted when the
SSE chunk carrying it arrives. A completed request's `usage.completion_tokens` are spread evenly
over its chunks with text (one chunk is usually one token); a failed request counts one token
per chunk it received.

"Backlogged" means a tenant has requests waiting for a seat: sent, and no token back yet. The
window runs from the latest tenant's first send to the earliest time a tenant's last request
got its first token (from then on that tenant has nothing waiting, and a fair scheduler owes it
no more seats). A tenant whose every request is already running takes at most one token per
request per engine step, so a low index is unfairness only when each tenant keeps requests
waiting; otherwise compare TTFT.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gapless.bench.client import RequestRecord
from gapless.bench.metrics import distribution
from gapless.bench.tenants import TenantSpec

MAX_SERIES_POINTS = 400  # per tenant kept in the JSON; the plot needs no more


@dataclass(frozen=True)
class Series:
    """A tenant's cumulative tokens received: t [k] s after the start (sorted), tokens [k]."""

    t: np.ndarray
    tokens: np.ndarray

    def at(self, when: float) -> float:
        """Tokens received up to and including `when`."""
        k = int(np.searchsorted(self.t, when, side="right"))
        return float(self.tokens[k - 1]) if k else 0.0

    @property
    def total(self) -> float:
        return float(self.tokens[-1]) if len(self.tokens) else 0.0


@dataclass(frozen=True)
class Window:
    """[start_s, end_s]: from the latest tenant's first send to the earliest time a tenant's
    last request got its first token. None for both, and `note` saying why, when there is none."""

    start_s: float | None
    end_s: float | None
    note: str | None = None

    @property
    def duration_s(self) -> float | None:
        if self.start_s is None or self.end_s is None:
            return None
        return self.end_s - self.start_s


def jain_index(values: Sequence[float]) -> float | None:
    """(sum x)^2 / (n * sum x^2): 1 when all x are equal, 1/n when one holds everything;
    None when there are none or all are 0."""
    x = np.asarray(values, dtype=float)
    square_sum = float((x * x).sum())
    if len(x) == 0 or square_sum == 0:
        return None
    return float(x.sum() ** 2 / (len(x) * square_sum))


def token_series(records: Sequence[RequestRecord], t0: float) -> Series:
    """Cumulative tokens of these requests' chunks, in arrival order."""
    times, counts = [], []
    for r in records:
        if r.ttft is None:
            continue
        chunk_t = r.start + r.ttft + np.concatenate(([0.0], np.cumsum(r.itl)))  # [chunks]
        per_chunk = r.output_tokens / len(chunk_t) if r.ok else 1.0
        times.append(chunk_t - t0)
        counts.append(np.full(len(chunk_t), per_chunk))
    if not times:
        return Series(np.zeros(0), np.zeros(0))
    t = np.concatenate(times)
    order = np.argsort(t, kind="stable")
    return Series(t[order], np.cumsum(np.concatenate(counts)[order]))


def backlogged_window(
    first_send: dict[str, float], last_start: dict[str, float | None], series: dict[str, Series]
) -> Window:
    """The window in which every tenant had sent and still had requests waiting; last_start is
    when each tenant's last request got its first token (None: one never did)."""
    starved = [name for name, s in series.items() if s.total == 0]
    if starved:
        return Window(None, None, f"no backlogged window: tenant {starved[0]} received no tokens")
    late = max(first_send, key=lambda name: first_send[name])
    ends = {name: t for name, t in last_start.items() if t is not None}
    early = min(ends, key=lambda name: ends[name]) if ends else None
    start = first_send[late]
    end = ends[early] if early is not None else max(float(s.t[-1]) for s in series.values())
    if end <= start:
        return Window(
            None,
            None,
            f"no backlogged window: tenant {early}'s last request started at {end:.3f} s, "
            f"before tenant {late} sent its first at {start:.3f} s",
        )
    return Window(start, end)


def last_start(records: Sequence[RequestRecord], t0: float) -> float | None:
    """When the last of these requests got its first token; None if one never did."""
    firsts = [r.start + r.ttft - t0 for r in records if r.ttft is not None]
    return max(firsts) if firsts and len(firsts) == len(records) else None


def _thinned(series: Series, first_send: float) -> dict[str, list[float]]:
    """The series for the JSON: starting at (first send, 0), at most MAX_SERIES_POINTS points,
    the last one kept."""
    t, tokens = series.t, series.tokens
    if len(t) > MAX_SERIES_POINTS:
        keep = np.linspace(0, len(t) - 1, MAX_SERIES_POINTS).round().astype(int)
        t, tokens = t[keep], tokens[keep]
    return {
        "t_s": np.round(np.concatenate(([first_send], t)), 4).tolist(),
        "tokens": np.round(np.concatenate(([0.0], tokens)), 2).tolist(),
    }


def tenant_report(
    records: Sequence[RequestRecord], t0: float, specs: Sequence[TenantSpec]
) -> dict[str, Any]:
    """The `tenants` (one object per tenant, in spec order) and `fairness` keys of a run."""
    mine = {s.name: [r for r in records if r.tenant == s.name] for s in specs}
    series = {name: token_series(rs, t0) for name, rs in mine.items()}
    first_send = {name: min(r.start for r in rs) - t0 for name, rs in mine.items() if rs}
    assert len(first_send) == len(specs), "every tenant sends at least one request"
    starts = {name: last_start(rs, t0) for name, rs in mine.items()}
    window = backlogged_window(first_send, starts, series)
    got: dict[str, float] = {}
    if window.start_s is not None and window.end_s is not None:
        got = {n: s.at(window.end_s) - s.at(window.start_s) for n, s in series.items()}
    total_got, total_weight = sum(got.values()), sum(s.weight for s in specs)
    tenants = []
    for spec in specs:
        row = _tenant_row(spec, mine[spec.name], series[spec.name], first_send[spec.name])
        row["window_tokens"] = got.get(spec.name)
        row["window_share"] = got[spec.name] / total_got if total_got else None
        row["weight_share"] = spec.weight / total_weight
        row["series"] = _thinned(series[spec.name], first_send[spec.name])
        tenants.append(row)
    jain = jain_index([got[s.name] / s.weight for s in specs]) if got else None
    note = window.note
    if note is None and jain is None:
        note = "no tokens were received in the backlogged window"
    fairness = {
        "window_start_s": window.start_s,
        "window_end_s": window.end_s,
        "window_s": window.duration_s,
        "jain_index": jain,
        "note": note,
    }
    return {"tenants": tenants, "fairness": fairness}


def _tenant_row(
    spec: TenantSpec, records: list[RequestRecord], series: Series, first_send: float
) -> dict[str, Any]:
    done = [r for r in records if r.ok]
    last = float(series.t[-1]) if len(series.t) else None
    span = last - first_send if last is not None else None  # s, first send to last token
    return {
        "name": spec.name,
        "priority": spec.priority,
        "weight": spec.weight,
        "start_s": spec.start_s,
        "again_s": list(spec.again_s),
        "rate": None if np.isinf(spec.rate) else spec.rate,
        "input_len": str(spec.input_len),
        "output_len": str(spec.output_len),
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "ttft_ms": distribution([r.ttft for r in done if r.ttft is not None]),
        "tokens_received": series.total,
        "output_token_throughput": series.total / span if span else None,  # tok/s over span
        "first_send_s": first_send,
        "last_token_s": last,
    }
