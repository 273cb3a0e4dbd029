"""How many drafts a step's rows may verify: speculation where it pays, none where it loses.

A verify row feeds 1 + k tokens and yields 1 + the drafts accepted. Where the device is bound
by memory (a few rows) the extra tokens cost almost nothing; where the step is already bound by
compute (a big batch, a long prompt chunk) every verified token costs as much as a decoded one
and a rejected draft is pure loss. Per step, with B drafting rows, R other sampling rows and T
tokens fed without drafts, the planner takes

    k* = argmax over k in 0..K of  (B * E(k) + R) / t(T + B * k)

where t(n) is the device's step time at n tokens (the runner's table: measured on cpu at start,
the profile's model on sim; RunnerReady) and E(k) = (1 - a^(k+1)) / (1 - a) the tokens a row
yields when each draft is accepted with probability a after the one before it was. a is
estimated from the results (accepted drafts over accepted plus the rejections that ended a
run), decayed so it follows the workload. k* = 0 stops speculation for that step. Without a
table (cuda, or speculation only by `prediction` on cpu) every row may verify its K.
"""

from __future__ import annotations

import numpy as np

PRIOR = 0.5  # acceptance assumed before any result, worth PRIOR_WEIGHT drafts
PRIOR_WEIGHT = 8.0
DECAY = 0.98  # per result with drafts: the estimate follows about the last 50 steps


class SpecCost:
    def __init__(self, tokens: list[int] | None = None, seconds: list[float] | None = None):
        """tokens [N] ascending, seconds [N] the device's step time at each (empty: no model)."""
        self.tokens = np.asarray(tokens or [], np.float64)
        # why the least over every size at or above: other work only slows a run down, and a
        # step of more tokens that ran in s seconds bounds one of fewer (monotone, too)
        self.seconds = np.minimum.accumulate(np.asarray(seconds or [], np.float64)[::-1])[::-1]
        self.accepted = 0.0  # decayed sums over results
        self.rejected = 0.0
        self.num_stopped = 0  # steps where some row could draft and k* was 0

    @property
    def has_model(self) -> bool:
        return len(self.tokens) >= 2

    @property
    def acceptance(self) -> float:
        return (self.accepted + PRIOR * PRIOR_WEIGHT) / (
            self.accepted + self.rejected + PRIOR_WEIGHT
        )

    def observe(self, drafted: np.ndarray, accepted: np.ndarray) -> None:
        """A result's [R] drafts verified and accepted per row."""
        rows = drafted > 0
        if not rows.any():
            return
        self.accepted = self.accepted * DECAY + float(accepted[rows].sum())
        self.rejected = self.rejected * DECAY + float((accepted[rows] < drafted[rows]).sum())

    def step_seconds(self, n: np.ndarray) -> np.ndarray:
        """t(n): interpolated in the table; past its end, each further token at the larger of
        the last segment's cost and the largest size's mean cost per token.
        why the mean: past a table's end a step is bound by arithmetic, where a token costs at
        least what it did on average; a last segment measured flat (a noisy run) would price
        a step of many rows' drafts as nearly free."""
        x, y = self.tokens, self.seconds
        t = np.interp(n, x, y)
        slope = max((y[-1] - y[-2]) / (x[-1] - x[-2]), y[-1] / x[-1])
        return np.where(n > x[-1], y[-1] + (n - x[-1]) * slope, t)

    def best_k(self, num_drafting: int, num_tokens: int, num_other: int, k_max: int) -> int:
        """k* for a step (see the module's doc); k_max when there is no model."""
        if not self.has_model or k_max <= 0 or num_drafting <= 0:
            return k_max
        k = np.arange(k_max + 1)
        a = min(self.acceptance, 1 - 1e-9)
        made = (1 - a ** (k + 1)) / (1 - a)  # [K + 1] tokens a row yields
        rate = (num_drafting * made + num_other) / self.step_seconds(num_tokens + num_drafting * k)
        best = int(np.argmax(rate))  # the first of equals: the fewest drafts
        self.num_stopped += best == 0
        return best
