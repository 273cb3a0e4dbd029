"""Time in tests that must hold on every machine that runs the suite (CPUs of several speeds,
shared with other jobs).

A test never asserts how fast the machine is (that is a benchmark). A test that checks a
deadline the server promises allows it `late_limit_s(bound)`: the bound plus a margin of 3x the
bound or 5 s, whichever is more, so that a loaded machine passes and a deadline that is not kept
at all still fails.
"""

from __future__ import annotations

MIN_MARGIN_S = 5.0


def late_limit_s(bound_s: float) -> float:
    """The most time a test lets pass before it calls a bound_s deadline missed."""
    return bound_s + max(3 * bound_s, MIN_MARGIN_S)
