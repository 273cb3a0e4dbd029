"""`gapless serve` started by the bench on a free port and always stopped afterwards."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(port: int, serve_args: Sequence[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "gapless.launch.cli",
        "serve",
        "--port",
        str(port),
        *serve_args,
    ]


def _tail(path: Path, num_lines: int = 60) -> str:
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(lines[-num_lines:])


@contextmanager
def launched_server(
    serve_args: Sequence[str] = (),
    *,
    startup_timeout_s: float = 600.0,
    stop_timeout_s: float = 60.0,
    command: Sequence[str] | None = None,
    port: int | None = None,
) -> Iterator[str]:
    """Yields the base URL once /health answers 200; SIGTERM (then SIGKILL) on the way out,
    whatever ended the block. `command` replaces `gapless serve` (it must listen on `port`)."""
    port = port or free_port()
    argv = list(command) if command is not None else serve_command(port, serve_args)
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkstemp(prefix="gapless-bench-serve-", suffix=".log")[1])
    with log.open("w") as out:
        # why: its own session, so a Ctrl-C at the bench reaches the server only as our SIGTERM
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    healthy = False
    try:
        _wait_healthy(proc, url, startup_timeout_s, log)
        healthy = True
        yield url
    finally:
        if healthy and proc.poll() is not None:
            print(
                f"bench: the server exited with {proc.returncode}:\n{_tail(log)}", file=sys.stderr
            )
        _stop(proc, stop_timeout_s)
        log.unlink(missing_ok=True)


def _wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the server exited with {proc.returncode} during startup:\n{_tail(log)}"
            )
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"the server was not healthy after {timeout_s:.0f}s:\n{_tail(log)}")


def _stop(proc: subprocess.Popen, timeout_s: float) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
