"""The device's step-time table that speculation's cost model reads (core/spec_cost.py): the
runner measures (cpu) or models (sim) a step's seconds at these token counts and sends the
table in RunnerReady."""

from __future__ import annotations


def table_sizes(max_tokens: int) -> list[int]:
    """The token counts a step-time table holds: 1, 2, 4, ... up to max_tokens, and it."""
    sizes = [1 << i for i in range(max_tokens.bit_length()) if 1 << i <= max_tokens]
    return sizes + ([max_tokens] if sizes[-1] != max_tokens else [])
