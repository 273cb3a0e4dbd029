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

    def step(self, requests: list[Request], result: StepResult) -> None:
        """A verify step's result: rows in the order of requests (the step's sampled rows)."""
        drafted = np.asarray(result.num_drafted, np.int64)  # [R]
        if not drafted.any():
            return
        accepted = np.asarray(result.counts, np.int64) - 1  # [R]
        by_method: dict[str, list[int]] = {}
        for j in np.flatnonzero(drafted).tolist():
            sums = by_method.setdefault(requests[j].draft_method, [0, 0])
            sums[0] += int(drafted[j])
            sums[1] += int(accepted[j])
        for method, (d, a) in by_method.items():
            self.drafted.labels(method).inc(d)
            if a:
                self.accepted.labels(method).inc(a)
        for i in range(min(int(drafted.max()), MAX_POSITIONS)):
            self._pos_drafted[i].inc(int((drafted > i).sum()))
            if n := int((accepted > i).sum()):
                self._pos_accepted[i].inc(n)
