"""Messages that decode but break an invariant of the process that receives them.

A frame that is not a message of its channel is the channel's to drop (common/channel.py,
`gapless_bad_frames_total`). A well-typed message can still be impossible: a request id that is
live already, a frontend id no frontend has, an empty prompt, a token outside the vocabulary, a
result of a step never planned, a plan naming a slot the runner does not hold. Each process
checks what it receives at its boundary; what breaks an invariant is logged, counted in
`gapless_bad_messages_total{process,reason}` and dropped (or ends that one request with an
error), and the process goes on. Asserts stay for invariants inside one process.
"""

from __future__ import annotations

import logging

from prometheus_client import Counter

_counter: Counter | None = None
LOG_FIRST = 10  # messages logged in full; past them one in LOG_EVERY (a flood must not flood logs)
LOG_EVERY = 1000


def bad_messages_counter() -> Counter:
    """`gapless_bad_messages_total{process,reason}`: one per process, in the default registry
    (multiprocess under `gapless serve`)."""
    global _counter
    if _counter is None:
        _counter = Counter(
            "gapless_bad_messages",
            "Internal messages dropped (or whose request was ended) because they break an "
            "invariant of the process that received them",
            ["process", "reason"],
        )
    return _counter


class BadMessages:
    """One process's reports: `report(reason, detail)` logs and counts one message. reason is a
    short fixed name (a label value); detail says what was wrong with this one."""

    def __init__(self, process: str, log: logging.Logger) -> None:
        self.process = process
        self.log = log
        self.num_bad = 0
        self._children: dict[str, Counter] = {}

    def report(self, reason: str, detail: str) -> None:
        self.num_bad += 1
        child = self._children.get(reason)
        if child is None:
            child = self._children[reason] = bad_messages_counter().labels(self.process, reason)
        child.inc()
        if self.num_bad <= LOG_FIRST or self.num_bad % LOG_EVERY == 0:
            self.log.warning(
                "%s: an impossible message (%s, %d so far): %s",
                self.process, reason, self.num_bad, detail,
            )  # fmt: skip
