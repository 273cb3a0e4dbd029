"""`python -m gapless.launch.worker ROLE [FRONTEND_ID | RANK]`: how the supervisor starts each
process (RANK: a tensor-parallel runner's, 0 when left out)."""

from __future__ import annotations

import ctypes
import gc
import os
import platform
import struct
import sys

from gapless.common.process import child_setup, parent_gone, remove_run


def _set_name(name: str) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6")
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME: shown by ps and top


# why: on a small machine the roles compete for cores; the core and the runner feed the
# device, so the roles that only stream text yield to them under contention. Both coalesce
# what they fall behind on, so they keep pace in tokens/s with less CPU. Sim h100-llama3.2-1b,
# 128 streams of 128:1024 on 2 cores, 10 alternating pairs: steady-decode idle 0.1-3.0% (mean
# 1.5%) at 10, 0.6-7.4% (mean 3.8%) at 5; median TPOT 1.92-2.08 ms against 1.97-2.18
NICE = {"detokenizer": 10, "frontend": 10}
# why: a core or runner woken by a message waited for a busy core for up to several ms, and the
# device with it; asking for a short slice lets it preempt sooner (Linux 6.12+, unprivileged).
# Sim h100-llama3.2-1b, 128 streams of 128:1024 on 2 cores, 4 runs each alternating: steady-
# decode idle 2.8-4.1% (mean 3.3%) with it, 3.7-6.4% (mean 4.8%) without
SLICE_NS = {"core": 100_000, "gpu_runner": 100_000}
_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}  # syscall numbers


def _ask_slice(ns: int) -> None:
    """Ask the kernel for a time slice of ns for this process (sched_attr.sched_runtime of
    SCHED_OTHER); a kernel without custom slices ignores or refuses it, and nothing changes."""
    number = _SCHED_SETATTR.get(platform.machine())
    if not sys.platform.startswith("linux") or number is None:
        return
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    # struct sched_attr: size, policy, flags, nice, priority, runtime, deadline, period, util
    attr = struct.pack("IIQiIQQQII", 56, 0, 0, nice, 0, ns, 0, 0, 0, 0)
    ctypes.CDLL(None, use_errno=True).syscall(number, 0, ctypes.create_string_buffer(attr), 0)


def main(argv: list[str]) -> None:
    role = argv[0]
    config = child_setup(role if len(argv) < 2 else f"{role}{argv[1]}")
    if NICE.get(role):
        os.nice(NICE[role])
    if SLICE_NS.get(role):
        _ask_slice(SLICE_NS[role])
    try:
        _run(role, config, argv)
    finally:
        if parent_gone():  # the supervisor died (SIGKILL, say): nobody else cleans up
            remove_run(config)
        # why: the interpreter's last collections walk every object torch's modules made, and
        # nothing they would free matters to a process that is ending; frozen objects are not
        # walked. Sim runner, supervisor SIGKILLed mid-stream, 3 runs each on a quiet 2-core
        # machine: exit 1.11-1.13 s after the kill without the freeze, 0.22-0.25 s with it (and
        # over 5 s once on a busy one: tests/core/test_serve_faults.py)
        gc.freeze()


def _run(role: str, config, argv: list[str]) -> None:
    # process titles (15 characters at most): replica k > 0 of --data-parallel-size ends
    # in .k, its runners are gapless-run{rank}.k
    k = f".{config.replica}" if config.replica else ""
    if role == "core":
        from gapless.core.process import run_core

        _set_name(f"gapless-core{k}")
        run_core(config)
    elif role == "gpu_runner":
        from gapless.gpu_runner.process import run_gpu_runner

        rank = int(argv[1]) if len(argv) > 1 else 0  # its tensor-parallel rank
        _set_name(f"gapless-run{rank}{k}" if k else f"gapless-runner{rank or ''}")
        run_gpu_runner(config, rank)
    elif role == "detokenizer":
        from gapless.detokenizer.process import run_detokenizer

        _set_name(f"gapless-detok{k}")
        run_detokenizer(config)
    elif role == "frontend":
        from gapless.frontend.server import run_frontend

        fid = int(argv[1])
        _set_name(f"gapless-front{fid}")
        run_frontend(config, fid)
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
