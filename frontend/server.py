"""Process entry of one frontend: uvicorn on a shared port, an engine client, READY."""

from __future__ import annotations

import asyncio
import contextlib
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

from gapless.core.common.config import EngineConfig
from gapless.core.common.process import ControlReporter, stop_requested
from gapless.frontend import metrics
from gapless.frontend.admission import Admission
from gapless.frontend.app import App
from gapless.frontend.engine_client import ZmqEngineClient
from gapless.frontend.http import head_limited
from gapless.frontend.prompts import Prompter
from gapless.frontend.state import FrontendState


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, admission: Admission) -> None:
        super().__init__(config)
        self.admission = admission

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.admission.draining = True  # new requests that still reach the app get 503
        super().handle_exit(sig, frame)

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
    state = FrontendState(config, engine, prompter, Admission(config, engine))
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
    server = _Server(
        uvicorn.Config(
            app,
            loop="uvloop",
            http=head_limited(config.max_head_bytes),
            lifespan="off",
            timeout_graceful_shutdown=config.drain_timeout_s,  # type: ignore[arg-type]
            log_level="warning",
        ),
        app.state.admission,
    )

    def exit_soon(reason: str) -> None:
        loop.call_later(config.dead_engine_grace_s, setattr, server, "should_exit", True)

    engine.on_dead(exit_soon)
    sock = bind_socket(config.host, config.port)
    try:
        serving = loop.create_task(server.serve(sockets=[sock]), name="uvicorn")
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        if stop_requested():  # SIGTERM came before uvicorn took the signal over
            app.state.admission.draining = True
            server.should_exit = True
        if server.started and reporter is not None:
            reporter.ready(frontend_id=frontend_id, port=sock.getsockname()[1])
        await serving
    finally:
        sock.close()
        await engine.close()
        executor.shutdown(wait=False, cancel_futures=True)


def run_frontend(config: EngineConfig, frontend_id: int) -> None:
    """Process entry (after core.process.child_setup): OpenAI-compatible HTTP on
    (config.host, config.port), shared by every frontend through SO_REUSEPORT. Reports READY
    once listening; on SIGTERM stops accepting and drains in-flight requests for up to
    config.drain_timeout_s; FATAL if it cannot start."""
    from gapless.core.common.model_files import load_tokenizer

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
