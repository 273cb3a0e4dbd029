"""Process entry of one frontend: uvicorn on a shared port, an engine client, READY."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import FrameType

import tokenizers
import uvicorn
import uvloop
import zmq

from gapless.common.config import EngineConfig
from gapless.common.process import ControlReporter, parent_gone, stop_requested
from gapless.frontend.api.prompts import Prompter
from gapless.frontend.api.responses_store import open_store
from gapless.frontend.api.state import FrontendState
from gapless.frontend.api.structured import Grammars
from gapless.frontend.app import App
from gapless.frontend.engine.admission import Admission
from gapless.frontend.engine.client import ZmqEngineClient
from gapless.frontend.http import metrics
from gapless.frontend.http.transport import bounded_protocol

log = logging.getLogger("gapless.frontend")


# s: what SIGTERM's drain leaves uvicorn, after the streams still running were cut, to write
# their last events and close
CUT_GRACE_S = 2.0
PARENT_POLL_S = 0.1  # how often the frontend looks for its supervisor
LOGGED_NAMES = 50  # request ids a log line lists before it says how many more


class _Server(uvicorn.Server):
    """uvicorn with gapless's staged exit: SIGTERM drains for drain_timeout_s, then cuts what
    still runs (each stream ends with an error event); the supervisor's death ends every
    stream at once."""

    def __init__(
        self,
        config: uvicorn.Config,
        admission: Admission,
        engine: ZmqEngineClient,
        drain_timeout_s: float,
        grammars: Grammars | None = None,
    ) -> None:
        super().__init__(config)
        self.admission = admission
        self.engine = engine
        self.grammars = grammars  # compiles in flight end at the cut too
        self.drain_timeout_s = drain_timeout_s
        self.loop = asyncio.get_running_loop()
        self.cut_timer: asyncio.TimerHandle | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # a signal handler: what touches the loop is handed to it
        if parent_gone():  # PR_SET_PDEATHSIG: the supervisor died, nothing is left to drain for
            self.loop.call_soon_threadsafe(self.supervisor_gone)
            return
        self.admission.draining = True  # new requests that still reach the app get 503
        if self.cut_timer is None:
            self.loop.call_soon_threadsafe(self._arm_cut)
        super().handle_exit(sig, frame)

    def _arm_cut(self) -> None:
        if self.cut_timer is None:
            self.cut_timer = self.loop.call_later(self.drain_timeout_s, self.cut)

    def cut(self) -> None:
        """The drain ran out of time: end every request still in flight here."""
        reason = f"the server is shutting down: the {self.drain_timeout_s:g} s drain ran out"
        if self.grammars is not None:  # a request still compiling gets its 503 now
            self.grammars.close()
        names = self.engine.cut_all(reason)
        if names:
            log.warning(
                "drain timeout: ended %d request(s) still in flight: %s",
                len(names),
                listed(sorted(names)),
            )

    def supervisor_gone(self) -> None:
        if self.engine.healthy:
            log.error("the supervisor exited; ending every request and stopping")
            self.engine.mark_dead("the server's supervisor exited; the engine is stopping")
        self.admission.draining = True
        self.should_exit = True
        # streams are ending with their error events; idle keep-alive connections close now
        self.config.timeout_graceful_shutdown = CUT_GRACE_S  # type: ignore[assignment]

    async def watch_parent(self) -> None:
        """Notices the supervisor's death without any signal (a liveness poll of our ppid)."""
        while not parent_gone():
            await asyncio.sleep(PARENT_POLL_S)
        self.supervisor_gone()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # why: SIGINT belongs to the supervisor (child_setup ignores it); SIGTERM starts uvicorn's
        # drain: stop accepting, let in-flight requests finish within timeout_graceful_shutdown
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(signal.SIGTERM, self.handle_exit)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)


def listed(names: list[str], most: int = LOGGED_NAMES) -> str:
    """The first `most` names, then how many more."""
    shown = ", ".join(names[:most])
    return shown if len(names) <= most else f"{shown} and {len(names) - most} more"


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket that other frontends of this run may bind as well."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def build_app(
    config: EngineConfig, engine: ZmqEngineClient, tokenizer: tokenizers.Tokenizer
) -> tuple[App, ThreadPoolExecutor]:
    # 2 threads: chat templates and tokenizing must not queue behind one long prompt
    executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="frontend-prep")
    prompter = Prompter(tokenizer, config, executor)
    store = open_store(config)
    state = FrontendState(config, engine, prompter, Admission(config, engine), store)
    return App(state), executor


async def serve(
    config: EngineConfig,
    frontend_id: int,
    tokenizer: tokenizers.Tokenizer,
    ctx: zmq.Context,
    reporter: ControlReporter | None,
) -> None:
    """Serves until SIGTERM (drains) or until dead_engine_grace_s after the engine died."""
    loop = asyncio.get_running_loop()
    engine = ZmqEngineClient(config, frontend_id, ctx)
    engine.start()
    app, executor = build_app(config, engine, tokenizer)
    grammars = app.state.prompter.grammars
    grammars.warm()  # why now: a worker's start would otherwise fall on the first schema
    server = _Server(
        uvicorn.Config(
            app,
            loop="uvloop",
            http=bounded_protocol(config),
            timeout_keep_alive=config.keep_alive_timeout_s,  # type: ignore[arg-type]
            lifespan="off",
            # why the grace: our own cut at drain_timeout_s ends the streams with an error
            # event; uvicorn's cancel, past this, would end them with nothing
            timeout_graceful_shutdown=config.drain_timeout_s + CUT_GRACE_S,  # type: ignore[arg-type]
            log_level="warning",
            log_config=None,  # why: common.logs set logging up for the whole process
        ),
        app.state.admission,
        engine,
        config.drain_timeout_s,
        grammars,
    )

    def exit_soon(reason: str) -> None:
        loop.call_later(config.dead_engine_grace_s, setattr, server, "should_exit", True)

    engine.on_dead(exit_soon)
    # why: what startup made (tokenizer, templates, modules) stays for good; frozen, the
    # collections that every step's allocations set off no longer walk it (bench/RESULTS.md,
    # "`gc.freeze()` in the frontend")
    gc.collect()
    gc.freeze()
    sock = bind_socket(config.host, config.port)
    watcher = loop.create_task(server.watch_parent(), name="parent-watch")
    try:
        serving = loop.create_task(server.serve(sockets=[sock]), name="uvicorn")
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        if stop_requested():  # SIGTERM came before uvicorn took the signal over
            server.handle_exit(signal.SIGTERM, None)
        if server.started and reporter is not None:
            reporter.ready(frontend_id=frontend_id, port=sock.getsockname()[1])
        await serving
    finally:
        watcher.cancel()
        sock.close()
        grammars.close()  # kills the compile workers, whatever they are compiling
        await engine.close()
        executor.shutdown(wait=False, cancel_futures=True)


def run_frontend(config: EngineConfig, frontend_id: int) -> None:
    """Process entry (after core.process.child_setup): OpenAI-compatible HTTP on
    (config.host, config.port), shared by every frontend through SO_REUSEPORT. Reports READY
    once listening; on SIGTERM stops accepting and drains in-flight requests for up to
    config.drain_timeout_s; FATAL if it cannot start."""
    from gapless.common.model_files import load_tokenizer

    ctx = zmq.Context()
    reporter = ControlReporter(ctx, config, f"frontend{frontend_id}")
    try:
        tokenizer = load_tokenizer(config.model)
        metrics.set_observer(metrics.PrometheusObserver())
        uvloop.run(serve(config, frontend_id, tokenizer, ctx, reporter))
    except Exception as exc:
        reporter.fatal(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        reporter.close()
        ctx.term()
