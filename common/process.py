"""What every gapless child process shares: config from the environment, parent-death
detection, SIGTERM as a request to stop, and the READY / FATAL reports to the supervisor."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys
import threading

import zmq

from gapless.common.channel import Sender
from gapless.common.config import CONFIG_ENV, EngineConfig, decode_config
from gapless.common.logs import setup_logging
from gapless.common.messages import ControlMessage, Fatal, Ready
from gapless.shm import names as shm

# ipc socket names inside the run directory; the receiving side binds
CORE_IN = "core_in"  # frontends and detokenizer -> core
RUNNER_IN = "runner_in"  # core -> gpu_runner
RUNNER_OUT = "runner_out"  # gpu_runner -> core
RUNNER_PLANS = "runner_plans"  # core -> every rank of a tensor-parallel runner (published)
DETOK_IN = "detok_in"  # core -> detokenizer
CONTROL = "control"  # every process -> supervisor


ROLE_NAMES = {"gpu_runner": "runner", "detokenizer": "detok"}  # as logs name them


def frontend_socket(frontend_id: int) -> str:
    return f"frontend_{frontend_id}"


def plan_endpoints(config: EngineConfig) -> list[str]:
    """Where the core publishes plans to tensor-parallel ranks: its run directory, and for
    ranks on other hosts the port after --master-port on --master-addr."""
    endpoints = [config.engine_ipc(RUNNER_PLANS)]
    if config.nnodes > 1:
        endpoints.append(f"tcp://{config.master_addr}:{config.master_port + 1}")
    return endpoints


def plan_endpoint(config: EngineConfig) -> str:
    """Where this host's ranks read the plans (plan_endpoints)."""
    return plan_endpoints(config)[0 if config.node_rank == 0 else 1]


_stop = threading.Event()
_parent_pid: int | None = None  # the supervisor, as child_setup found it


def stop_requested() -> bool:
    """True once SIGTERM arrived or the parent died; busy loops check it between steps."""
    return _stop.is_set()


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def parent_gone() -> bool:
    """True once the supervisor that started this process has exited (we were re-parented)."""
    return _parent_pid is not None and os.getppid() != _parent_pid


def remove_run(config: EngineConfig) -> None:
    """Remove the run directory and the run's shared-memory rings: what a supervisor that died
    could not. Every process left does it as it exits; the last one leaves nothing."""
    if config.run_dir:
        shutil.rmtree(config.run_dir, ignore_errors=True)
        shm.cleanup_run(shm.run_id_of(config.run_dir))


def child_setup(role: str) -> EngineConfig:
    """Call first in a child: returns the config and arms signals. SIGINT is the supervisor's."""
    global _parent_pid
    config = decode_config(os.environ[CONFIG_ENV])
    _parent_pid = os.getppid()
    setup_logging(
        config.log_level, config.log_format, _speaks_as(config, ROLE_NAMES.get(role, role))
    )
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_term)
    return config


_term_seen = False  # a SIGTERM's handler ran (or is running)


def _on_term(_signum: int, _frame: object) -> None:
    """SIGTERM: stop. why the flag before the Event: a second SIGTERM (the parent's death
    signal beside a kill) may interrupt this handler inside Event.set, which holds a lock that
    is not reentrant; a second set() there waited on it forever, and the process never ended."""
    global _term_seen
    if _term_seen:
        return
    _term_seen = True
    _stop.set()


def _speaks_as(config: EngineConfig, role: str) -> str:
    """How a process names itself in logs and to the supervisor: an engine process as its
    replica's (EngineConfig.role_name); a frontend serves every replica."""
    return role if role.startswith("frontend") else config.role_name(role)


class ControlReporter:
    """Sends READY and FATAL to the supervisor's control socket."""

    def __init__(self, ctx: zmq.Context, config: EngineConfig, role: str) -> None:
        self.role = _speaks_as(config, role)
        self._sender: Sender[ControlMessage] = Sender(ctx, config.ipc(CONTROL))

    def ready(self, **info: int) -> None:
        self._sender.send(Ready(role=self.role, pid=os.getpid(), info=info))

    def fatal(self, message: str) -> None:
        self._sender.send(Fatal(role=self.role, message=message))

    def close(self) -> None:
        self._sender.socket.close(linger=500)
