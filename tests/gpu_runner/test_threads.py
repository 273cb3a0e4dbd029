"""The cpu device's OpenMP wait policy reaches the environment before torch loads."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import os, sys
from gapless.gpu_runner.threads import set_wait_policy
os.environ.pop("OMP_WAIT_POLICY", None)
os.environ.pop("KMP_BLOCKTIME", None)
os.environ.pop("GOMP_SPINCOUNT", None)
before = set_wait_policy(sys.argv[1])
policy = os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT")
import torch
after = set_wait_policy(sys.argv[1])
print(before, policy, after)
"""


def check(policy: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", CHECK, policy], capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_passive_is_set_before_torch_loads_and_refused_after() -> None:
    assert check("passive") == "True ('PASSIVE', None) False"


def test_short_bounds_the_spin() -> None:
    assert check("short") == "True (None, '3000') False"


def test_spin_leaves_the_runtime_default() -> None:
    assert check("spin") == "True (None, None) False"


def test_the_runner_process_sets_the_policy_before_it_imports_torch() -> None:
    code = (
        "import sys; import gapless.core.launch.worker, gapless.gpu_runner.process, "
        "gapless.core.launch.cli; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
