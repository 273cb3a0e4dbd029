"""The supervisor behind `gapless serve`: spawns every process, waits for READY, watches them,
and shuts them down in stages."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import zmq

from gapless import shm
from gapless.common import metrics
from gapless.common.channel import Receiver, Sender
from gapless.common.config import CONFIG_ENV, EngineConfig, encode_config
from gapless.common.logs import setup_logging
from gapless.common.messages import ControlMessage, EngineDead, Fatal, Ready, Shutdown
from gapless.common.metrics import MULTIPROC_ENV
from gapless.common.process import CONTROL, CORE_IN, DETOK_IN, RUNNER_IN, frontend_socket
from gapless.shm.names import pid_alive

ENGINE_ROLES = ("gpu_runner", "core", "detokenizer")
RUN_PREFIX = "gapless-"


log = logging.getLogger("gapless.supervisor")


def _log(msg: str) -> None:
    log.info(msg)


def make_run_dir() -> str:
    """A private 0700 directory for this run's ipc sockets; stale ones of dead runs go first."""
    base = Path(tempfile.gettempdir())
    for old in base.glob(RUN_PREFIX + "*"):
        try:
            pid = int(old.name.split("-")[1])
        except (IndexError, ValueError):
            continue
        if not pid_alive(pid):
            shutil.rmtree(old, ignore_errors=True)
    shm.sweep_stale()  # rings a killed run could not unlink
    return tempfile.mkdtemp(prefix=f"{RUN_PREFIX}{os.getpid()}-", dir=base)


def device_note(info: dict[str, int]) -> str:
    """What the cuda runner's READY adds to the ready line: the KV cache's size, the memory
    budget it was sized in, and that every kernel was built and run."""
    if "kv_cache_bytes" not in info:
        return ""
    gib = 2**30
    note = f", KV cache {info['kv_cache_bytes'] / gib:.2f} GiB"
    if "memory_budget_bytes" in info:
        share = info["memory_budget_bytes"] / info["memory_total_bytes"]
        note += (
            f" of a {info['memory_budget_bytes'] / gib:.2f} GiB budget "
            f"({share:.2f} of {info['memory_total_bytes'] / gib:.2f} GiB)"
        )
    return note + ", kernels built and warmed up"


class EngineFailed(Exception):
    pass


class Supervisor:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # every process writes its Prometheus series here; removed with the run directory
        self.metrics_dir = os.path.join(config.run_dir, "metrics")
        os.makedirs(self.metrics_dir, mode=0o700, exist_ok=True)
        metrics.write_to(self.metrics_dir)  # the control socket's bad-frame count, say
        self.ctx = zmq.Context()
        self.control: Receiver[ControlMessage] = Receiver(
            self.ctx, config.ipc(CONTROL), ControlMessage
        )
        self.procs: dict[str, subprocess.Popen] = {}
        self.stopping = False

    def spawn(self, role: str, *args: str, config: EngineConfig | None = None) -> None:
        """Start one process; `config` is an engine replica's (EngineConfig.replica), named
        after it (EngineConfig.role_name)."""
        config = config or self.config
        env = dict(
            os.environ, **{CONFIG_ENV: encode_config(config), MULTIPROC_ENV: self.metrics_dir}
        )
        if config.replica and config.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = replica_gpus(config)
        name = config.role_name(role if not args else f"{role}{args[0]}")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "gapless.launch.worker", role, *args],
            env=env,
            stdin=subprocess.DEVNULL,
        )

    def wait_ready(self, names: list[str]) -> dict[str, Ready]:
        pending, ready = set(names), {}
        while pending:
            if self.stopping:
                raise EngineFailed("stopped while starting")
            self.check_alive()
            msg = self.control.recv(timeout_ms=100)
            match msg:
                case Ready(role=role):
                    key = role if role in pending else None
                    if key:
                        pending.discard(key)
                        ready[key] = msg
                case Fatal(role=role, message=message):
                    raise EngineFailed(f"{role} failed: {message}")
        return ready

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                raise EngineFailed(f"process {name} (pid {proc.pid}) exited with code {code}")

    def watch(self) -> None:
        """Until a stop is asked for: raise EngineFailed when any process dies or reports FATAL."""
        while not self.stopping:
            self.check_alive()
            match self.control.recv(timeout_ms=100):
                case Fatal(role=role, message=message):
                    raise EngineFailed(f"{role} failed: {message}")

    def tell_frontends_dead(self, reason: str) -> None:
        for i in range(self.config.api_servers):
            name = f"frontend{i}"
            if name in self.procs and self.procs[name].poll() is None:
                s: Sender = Sender(self.ctx, self.config.ipc(frontend_socket(i)))
                s.send(EngineDead(reason=reason))
                s.socket.close(linger=200)

    def stop_frontends(self, timeout: float) -> None:
        fronts = [p for n, p in self.procs.items() if n.startswith("frontend")]
        for p in fronts:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        _wait_all(fronts, timeout)

    def stop_engine(self, timeout: float = 5.0) -> None:
        # tensor-parallel ranks read only the core's publisher: the core tells them
        runner = (RUNNER_IN,) if self.config.num_ranks == 1 else ()
        for replica in range(self.config.data_parallel_size):
            for addr in (CORE_IN, *runner, DETOK_IN):
                s: Sender = Sender(self.ctx, self.config.engine_ipc(addr, replica))
                s.send(Shutdown())
                s.socket.close(linger=200)
        engine = [p for n, p in self.procs.items() if not n.startswith("frontend")]
        _wait_all(engine, timeout)

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)
        self.control.close()
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.config.run_dir, ignore_errors=True)
        shm.cleanup_run(shm.run_id_of(self.config.run_dir))


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def replica_gpus(config: EngineConfig) -> str:
    """CUDA_VISIBLE_DEVICES of a replica's processes: the tensor_parallel_size GPUs after the
    earlier replicas', counted in the caller's CUDA_VISIBLE_DEVICES when it sets one."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    size = config.tensor_parallel_size
    first = config.replica * size
    if visible is None:
        return ",".join(str(i) for i in range(first, first + size))
    listed = [g for g in visible.split(",") if g.strip()]
    if len(listed) < first + size:
        raise EngineFailed(
            f"--data-parallel-size {config.data_parallel_size} × --tensor-parallel-size "
            f"{size} needs {config.data_parallel_size * size} GPUs, CUDA_VISIBLE_DEVICES "
            f"lists {len(listed)}"
        )
    return ",".join(listed[first : first + size])


def replicas(config: EngineConfig) -> list[EngineConfig]:
    """Each engine replica's config: its number and, with tensor-parallel ranks, a TCP store
    of its own (replica 0 keeps --master-port)."""
    out = [config]
    for k in range(1, config.data_parallel_size):
        port = free_port(config.master_addr) if config.num_ranks > 1 else config.master_port
        out.append(msgspec.structs.replace(config, replica=k, master_port=port))
    return out


def spawn_runners(sup: Supervisor, config: EngineConfig | None = None) -> None:
    """The runner, or one process per tensor-parallel rank of this host (gpu_runner for rank
    0, gpu_runner1, ...), of one replica: each watched like every process, any one's death
    the engine's."""
    c = config or sup.config
    per_host = c.num_ranks // c.nnodes
    for rank in range(c.node_rank * per_host, (c.node_rank + 1) * per_host):
        sup.spawn("gpu_runner", *([str(rank)] if rank else []), config=c)


def serve_headless(sup: Supervisor) -> int:
    """This host's ranks only (--headless): they join host 0's group and read its plans.
    Exit 0 when they all stop on host 0's Shutdown or on SIGTERM here, 1 when one fails."""
    c = sup.config
    _log(f"ranks of host {c.node_rank} of {c.nnodes} joining {c.master_addr}:{c.master_port}")
    spawn_runners(sup)
    try:
        while not sup.stopping:
            codes = [p.poll() for p in sup.procs.values()]
            if all(code == 0 for code in codes):
                _log("stopped: host 0 shut the engine down")
                return 0
            for name, proc in sup.procs.items():
                if proc.poll() not in (None, 0):
                    raise EngineFailed(f"process {name} (pid {proc.pid}) exited with code "
                                       f"{proc.returncode}")  # fmt: skip
            match sup.control.recv(timeout_ms=100):
                case Fatal(role=role, message=message):
                    raise EngineFailed(f"{role} failed: {message}")
    except EngineFailed as e:
        log.error(f"engine failed: {e}")
        return 1
    finally:
        sup.close()
    _log("stopped")
    return 0


def serve(config: EngineConfig) -> int:
    """Runs the whole engine until SIGTERM/SIGINT (exit 0) or a process dies (exit 1)."""
    setup_logging(config.log_level, config.log_format, "supervisor")
    config = msgspec.structs.replace(config, run_dir=make_run_dir())
    if config.num_ranks > 1 and not config.master_port:
        port = free_port(config.master_addr)  # the group's TCP store, served by rank 0
        config = msgspec.structs.replace(config, master_port=port)
    sup = Supervisor(config)

    def on_signal(signum, _frame) -> None:
        if sup.stopping:
            return
        sup.stopping = True
        _log(f"{signal.Signals(signum).name}: draining in-flight requests, then stopping")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if config.headless:
        return serve_headless(sup)
    try:
        _log(f"loading {config.model.path} on {config.device} ...")
        t0 = time.monotonic()
        engines = replicas(config)
        for replica in engines:
            spawn_runners(sup, replica)
            for role in ENGINE_ROLES[1:]:
                sup.spawn(role, config=replica)
        ready = sup.wait_ready([r.role_name(role) for r in engines for role in ENGINE_ROLES])
        # block 0 is reserved for padding; report what requests can hold, as /metrics does
        blocks = max(0, ready["core"].info.get("num_kv_blocks", 0) - 1)
        _log(
            f"engine ready in {time.monotonic() - t0:.1f}s: {config.model.architecture}, "
            f"{blocks} KV blocks of "
            f"{config.block_size} tokens ({blocks * config.block_size} tokens)"
            + (f" in each of {m} replicas" if (m := config.data_parallel_size) > 1 else "")
            + device_note(ready["gpu_runner"].info)
            + (f", {n} tensor-parallel ranks" if (n := config.num_ranks) > 1 else "")
        )
        for i in range(config.api_servers):
            sup.spawn("frontend", str(i))
        sup.wait_ready([f"frontend{i}" for i in range(config.api_servers)])
        _log(f"serving {config.served_model_name} on http://{config.host}:{config.port}")
        sup.watch()
    except EngineFailed as e:
        if sup.stopping and str(e) == "stopped while starting":
            sup.close()
            return 0
        log.error(f"engine failed: {e}")
        sup.tell_frontends_dead(str(e))
        time.sleep(config.dead_engine_grace_s)
        sup.close()
        return 1
    # a stop was asked for: frontends drain first, then the engine stops
    sup.stop_frontends(config.drain_timeout_s + 5)
    sup.stop_engine()
    sup.close()
    _log("stopped")
    return 0
