"""How the cpu device's torch threads wait between parallel regions.

torch runs its cpu kernels (and MKL's and oneDNN's) on one OpenMP thread team. By default an
idle team member spins for a while before it sleeps, which is fastest on an idle machine and a
collapse on a busy one: the spinning threads burn the slices of the one thread the others wait
for at the next barrier. The policy is read once, when the OpenMP runtime loads with torch, so
it goes into the environment before the runner imports torch.
"""

from __future__ import annotations

import os
import sys

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
