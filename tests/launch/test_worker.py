"""The worker entry's scheduling requests: a short time slice for the roles that feed the device."""

from __future__ import annotations

import platform
import re
import subprocess
import sys

import pytest

from gapless.launch.worker import SLICE_NS


def _kernel() -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", platform.release())
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def test_the_core_and_runner_ask_for_a_short_slice():
    assert SLICE_NS.keys() == {"core", "gpu_runner"}
    if not sys.platform.startswith("linux") or _kernel() < (6, 12):
        pytest.skip("custom time slices need Linux 6.12 or later")
    code = (
        "from gapless.launch.worker import _ask_slice; _ask_slice(123_000); "
        "print(open('/proc/self/sched').read())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    m = re.search(r"^se\.slice\s*:\s*(\d+)", out.stdout, re.M)
    assert m is not None and int(m.group(1)) == 123_000, out.stdout[:2000]
