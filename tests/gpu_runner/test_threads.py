"""The cpu device's OpenMP wait policy reaches the environment before torch loads."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import os, sys
from gapless.gpu_runner.cpu.threads import set_wait_policy
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
        "import sys; import gapless.launch.worker, gapless.gpu_runner.process, "
        "gapless.launch.cli; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_busy_cores_counts_the_rest_of_the_machine(tmp_path, monkeypatch) -> None:
    from gapless.gpu_runner.cpu import threads

    stat = tmp_path / "stat"
    clock, own = [0.0], [0.0]
    monkeypatch.setattr(threads.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(threads.time, "process_time", lambda: own[0])
    busy = threads.BusyCores(period_s=0.5, threshold=0.5, path=str(stat))
    busy.tick = 100

    def look(t: float, busy_ticks: int, own_s: float) -> bool:
        clock[0], own[0] = t, own_s
        # user nice system idle iowait irq softirq steal: busy in user, idle in idle
        stat.write_text(f"cpu  {busy_ticks} 0 0 5000 7 0 0 0 0 0\ncpu0 0 0 0 0\n")
        return busy()

    assert not look(0.0, 0, 0.0)  # a first look has nothing to compare
    assert not look(1.0, 100, 0.9)  # 1 s of busy cores, 0.9 of it this process's
    assert not look(1.2, 300, 0.9), "within the period: the last answer"
    assert look(2.0, 250, 1.8)  # 1.5 s busy, 0.9 ours: the rest used 0.6 of a core
    assert not look(3.0, 300, 2.2)  # 0.5 s busy, 0.4 ours
    stat.unlink()
    assert not look(4.0, 0, 2.2), "no /proc/stat: never busy"


def test_one_row_steps_take_one_thread_while_the_cores_are_busy() -> None:
    import torch

    from gapless.gpu_runner.cpu.threads import ThreadSizer

    before = torch.get_num_threads()
    state = {"busy": True}
    size_threads = ThreadSizer(2, busy=lambda: state["busy"])
    try:
        torch.set_num_threads(2)
        size_threads(1)
        assert torch.get_num_threads() == 1
        size_threads(4)  # a batch keeps every thread, busy or not
        assert torch.get_num_threads() == 2
        state["busy"] = False
        size_threads(1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
