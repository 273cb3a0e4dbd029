"""`python -m gapless.core.launch.worker ROLE [FRONTEND_ID]`: how the supervisor starts each process."""

from __future__ import annotations

import ctypes
import os
import sys

from gapless.core.common.process import child_setup, parent_gone, remove_run


def _set_name(name: str) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6")
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME: shown by ps and top


# why: on a small machine the roles compete for cores; the core and the runner feed the
# device, so the roles that only stream text yield to them under contention
NICE = {"detokenizer": 5, "frontend": 5}


def main(argv: list[str]) -> None:
    role = argv[0]
    config = child_setup(role if role != "frontend" else f"frontend{argv[1]}")
    if NICE.get(role):
        os.nice(NICE[role])
    try:
        _run(role, config, argv)
    finally:
        if parent_gone():  # the supervisor died (SIGKILL, say): nobody else cleans up
            remove_run(config)


def _run(role: str, config, argv: list[str]) -> None:
    if role == "core":
        from gapless.core.process import run_core

        _set_name("gapless-core")
        run_core(config)
    elif role == "gpu_runner":
        from gapless.gpu_runner.process import run_gpu_runner

        _set_name("gapless-runner")
        run_gpu_runner(config)
    elif role == "detokenizer":
        from gapless.detokenizer.process import run_detokenizer

        _set_name("gapless-detok")
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
