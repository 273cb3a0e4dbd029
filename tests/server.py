"""Start `gapless serve` as a real subprocess for whole-system tests."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]

# Whole servers (`gapless serve`) one test run may start, all pytest-xdist workers summed; past
# it the run fails (tests/conftest.py), so growth shows before it costs the suite minutes.
# Measured: 36 (`make test`, 2026-11-28); raise it with a reason, or share a server instead.
SERVER_BUDGET = 40
# the folder where each test process counts the servers it starts, one file per process; the
# run's first process (xdist's controller) makes it and sums it at the end
SERVER_COUNTS_ENV = "GAPLESS_TEST_SERVER_COUNTS"


def count_server_start() -> None:
    """Counts one server started, in this process's file of the run's folder."""
    folder = os.environ.get(SERVER_COUNTS_ENV)
    if folder:
        with open(Path(folder) / f"{os.getpid()}.count", "a") as f:
            f.write("1\n")


def servers_started(folder: Path) -> int:
    """The servers every process of the run counted in folder."""
    return sum(len(path.read_text().splitlines()) for path in folder.glob("*.count"))


# Ports a test hands to a server lie below the kernel's ephemeral range (32768 and up on Linux),
# so that no port-0 bind or outgoing connection anywhere on the machine takes one between the
# test picking it and the server binding it; each pytest-xdist worker draws from its own slice.
PORTS_FROM, PORTS_TO = 12000, 32000
_ports = random.Random()


def free_port() -> int:
    """A port no one listens on now, below the ephemeral range, from this worker's slice."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker) if worker.isdigit() else 0
    width = (PORTS_TO - PORTS_FROM) // max(workers, 1)
    low = PORTS_FROM + index * width
    for _ in range(200):
        port = _ports.randrange(low, low + width)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{low + width}")


class Server:
    def __init__(self, *args: str, startup_timeout: float = 180.0, compile: bool = False) -> None:
        """compile=False serves with --no-compile: a cold compile per server would cost the
        suite minutes; tests/gpu_runner/test_compiled.py covers the compiled step."""
        count_server_start()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            # one torch thread: the test process and the other roles share the two cores
            [
                sys.executable,
                "-m",
                "gapless.launch.cli",
                "serve",
                "--port",
                str(self.port),
                "--threads",
                "1",
                *([] if compile else ["--no-compile"]),
                *args,
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.log: list[str] = []
        # why a thread: the server logs a line per request, and a pipe nobody reads fills up
        # and stops it
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("gapless serve exited during startup:\n" + self.read_log())
            # why the log line too: /health answers once the first frontend listens; the
            # supervisor logs "serving ... on http://" when every frontend has (--api-servers)
            serving = any(" on http://" in line and "serving " in line for line in self.log)
            try:
                if serving and httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError("gapless serve did not become healthy:\n" + self.read_log())

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line)

    def read_log(self) -> str:
        """What the server wrote so far (all of it once it exited)."""
        if self.proc.poll() is not None:
            self._reader.join(10)
        return "".join(self.log)

    def run_dir(self) -> str | None:
        """The run directory of this server, found by its supervisor's pid."""
        import tempfile

        for p in Path(tempfile.gettempdir()).glob(f"gapless-{self.proc.pid}-*"):
            return str(p)
        return None

    def child_pids(self) -> dict[str, int]:
        out = {}
        for line in subprocess.run(
            ["ps", "-o", "pid=,comm=", "--ppid", str(self.proc.pid)], capture_output=True, text=True
        ).stdout.splitlines():
            pid, comm = line.split(None, 1)
            out[comm.strip()] = int(pid)
        return out

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.read_log()
        return self.proc.returncode
