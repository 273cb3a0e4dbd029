"""Speculative decoding's Prometheus series: drafted and accepted tokens by method, and by
position in the draft (the acceptance at position i is accepted / drafted there)."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, Counter

from gapless.common.messages import StepResult
from gapless.core.request import Request

MAX_POSITIONS = 16  # --num-speculative-tokens' bound: one label per draft position


class SpecMetrics:
    def __init__(self, r: CollectorRegistry | None) -> None:
        self.drafted = Counter(
            "gapless_spec_draft_tokens",
            "Drafted tokens verified, by drafting method (ngram, prediction)",
            ["method"],
            registry=r,
        )
        self.accepted = Counter(
            "gapless_spec_accepted_tokens",
            "Drafted tokens accepted (they equal what speculation off samples), by method",
            ["method"],
            registry=r,
        )
        self.position_drafted = Counter(
            "gapless_spec_position_drafted",
            "Drafts verified at each position of a draft (0: the first after the last token)",
            ["position"],
            registry=r,
        )
        self.position_accepted = Counter(
            "gapless_spec_position_accepted",
            "Drafts accepted at each position of a draft",
            ["position"],
            registry=r,
        )
        labels = [str(i) for i in range(MAX_POSITIONS)]
        self._pos_drafted = [self.position_drafted.labels(p) for p in labels]
        self._pos_accepted = [self.position_accepted.labels(p) for p in labels]
        self._by_method: dict[str, tuple[Counter, Counter]] = {}  # method -> its two series

    def step(self, requests: list[Request], result: StepResult) -> None:
        """A verify step's result: rows in the order of requests (the step's sampled rows)."""
        drafted = np.asarray(result.num_drafted, np.int64)  # [R]
        if not drafted.any():
            return
        accepted = np.asarray(result.counts, np.int64) - 1  # [R]
        rows = np.flatnonzero(drafted)
        methods = [requests[j].draft_method for j in rows.tolist()]
        if methods.count(methods[0]) == len(methods):  # one method: the usual case
            self._add(methods[0], int(drafted.sum()), int(accepted.sum()))
        else:
            for method in set(methods):
                mine = rows[[m == method for m in methods]]
                self._add(method, int(drafted[mine].sum()), int(accepted[mine].sum()))
        width = min(int(drafted.max()), MAX_POSITIONS)
        # rows whose draft reached position i, and rows that accepted it, i < width
        at_drafted = _at_least(drafted, width)
        at_accepted = _at_least(accepted, width)
        for i, (d, a) in enumerate(zip(at_drafted, at_accepted, strict=True)):
            self._pos_drafted[i].inc(d)
            if a:
                self._pos_accepted[i].inc(a)

    def _add(self, method: str, drafted: int, accepted: int) -> None:
        series = self._by_method.get(method)
        if series is None:
            series = self._by_method[method] = (
                self.drafted.labels(method),
                self.accepted.labels(method),
            )
        series[0].inc(drafted)
        if accepted:
            series[1].inc(accepted)


def _at_least(counts: np.ndarray, width: int) -> list[int]:
    """[width] how many of [R] counts exceed i, for each position i."""
    tail = np.bincount(counts, minlength=width + 1)[::-1].cumsum()[::-1]  # [>= width + 1]
    return tail[1 : width + 1].tolist()
