"""How the cpu device's torch threads wait between parallel regions.

torch runs its cpu kernels (and MKL's and oneDNN's) on one OpenMP thread team. By default an
idle team member spins for a while before it sleeps, which is fastest on an idle machine and a
collapse on a busy one: the spinning threads burn the slices of the one thread the others wait
for at the next barrier. The policy is read once, when the OpenMP runtime loads with torch, so
it goes into the environment before the runner imports torch.

BusyCores tells the runner when other programs keep the cores busy, so a one-row step can
take one thread (how many threads run, unlike how they wait, can change at any time).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable

log = logging.getLogger("gapless.gpu_runner")

# the policy's environment for GNU OpenMP (torch's cpu builds) and Intel's, which reads
# KMP_BLOCKTIME instead; a variable the operator set is left alone
WAIT_ENV = {
    "short": {"GOMP_SPINCOUNT": "3000", "KMP_BLOCKTIME": "1"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"},
    "spin": {},
}


def set_wait_policy(policy: str) -> bool:
    """Put the policy into this process's environment; False when torch is loaded already
    (then it is too late, and the runtime keeps the policy it started with)."""
    assert policy in WAIT_ENV, f"unknown wait policy {policy!r}"
    if "torch" in sys.modules:
        return False
    for name, value in WAIT_ENV[policy].items():
        os.environ.setdefault(name, value)
    return True


class BusyCores:
    """Whether other programs keep this machine's cores busy, for one-row steps.

    why: one stream on two threads kept a fraction of its quiet speed beside busy loops, on
    one thread nearly all of it, and one thread costs little when the cores are idle
    (bench/RESULTS.md, "one stream under contention"). A step with one thread has no barrier
    for a parked thread to hold up.

    At most every `period_s`, the machine's busy CPU time since the last look (/proc/stat)
    less this process's own: busy when the rest used more than `threshold` of a core. (Not
    /proc/loadavg's count of runnable threads: it read 2 on an idle machine, the reader one.)
    """

    def __init__(
        self, period_s: float = 0.5, threshold: float = 0.5, path: str = "/proc/stat"
    ) -> None:
        self.period_s, self.threshold, self.path = period_s, threshold, path
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.busy = False
        self._last: tuple[float, float, float] | None = None  # (wall, machine busy s, own s)

    def _machine_busy_s(self) -> float:
        with open(self.path) as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle, iowait
        return (sum(fields[:8]) - idle) / self.tick  # user .. steal

    def __call__(self) -> bool:
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self.period_s:
            return self.busy
        try:
            machine = self._machine_busy_s()
        except (OSError, ValueError, IndexError):
            return False
        own = time.process_time()
        if self._last is not None:
            wall, machine0, own0 = self._last
            others = (machine - machine0) - (own - own0)
            self.busy = others / (now - wall) > self.threshold
        self._last = (now, machine, own)
        return self.busy


class ThreadSizer:
    """Before each forward: one thread for a one-row step while other programs keep the cores
    busy, else `threads` (the cpu backend's before_forward, where --threads is above one)."""

    def __init__(self, threads: int, busy: Callable[[], bool] | None = None) -> None:
        import torch  # why here: this module is imported before torch loads (set_wait_policy)

        self.threads = threads
        self.busy = BusyCores() if busy is None else busy
        self._get, self._set = torch.get_num_threads, torch.set_num_threads

    def __call__(self, rows: int) -> None:
        want = 1 if rows == 1 and self.busy() else self.threads
        if want != self._get():
            log.debug("cpu threads: %d (%s)", want, "cores busy" if want == 1 else "cores free")
            self._set(want)
