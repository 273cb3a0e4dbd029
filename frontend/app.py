"""The ASGI app: a small router, API-key check, and one error boundary per request."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TypeVar
from urllib.parse import parse_qs, unquote

import msgspec
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4

from gapless.common import metrics as core_metrics
from gapless.common.lora import visible_adapters
from gapless.common.messages import HEARTBEAT_TIMEOUT_S, KEEP_STEPS
from gapless.frontend.api import lora_routes
from gapless.frontend.api.chat import handle_chat
from gapless.frontend.api.completions import handle_completions
from gapless.frontend.api.embeddings import handle_embeddings
from gapless.frontend.api.openapi import openapi_document
from gapless.frontend.api.replies import Health, ModelCard, ModelList
from gapless.frontend.api.responses import handle_responses, handle_stored
from gapless.frontend.api.state import FrontendState
from gapless.frontend.api.utility_routes import handle_detokenize, handle_tokenize, version
from gapless.frontend.engine.client import EngineDeadError
from gapless.frontend.engine.tenants import ANONYMOUS, ApiKeys, Caller
from gapless.frontend.http import metrics
from gapless.frontend.http.asgi import (
    CHUNK_WRITER,
    ClientGone,
    HttpRequest,
    Receive,
    Responder,
    Scope,
    Send,
    encoder,
)
from gapless.frontend.http.errors import ApiError

log = logging.getLogger("gapless.frontend")
access_log = logging.getLogger("gapless.access")
T = TypeVar("T")

Handler = Callable[[HttpRequest, Responder, Caller], Awaitable[None]]
# answered without an API key: probes and scrapers, which operators keep on a private network;
# --metrics-require-key takes /metrics out (it shows every tenant's name and traffic)
OPEN_PATHS = frozenset({"/health", "/live", "/metrics"})
MODEL_PREFIX = "/v1/models/"
LORA_TIMEOUT_S = 60.0  # s: a load waits for the runner to read the adapter's files
RESPONSE_PREFIX = "/v1/responses/"  # GET and DELETE {id}, GET {id}/input_items


class App:
    """`await app(scope, receive, send)`; routes by exact path, then method."""

    def __init__(self, state: FrontendState) -> None:
        self.state = state
        self._keys = ApiKeys(state.config)
        self._open = (
            frozenset({"/health", "/live"}) if state.config.metrics_require_key else OPEN_PATHS
        )
        self._created = int(time.time())
        self._openapi = msgspec.Raw(
            encoder.encode(openapi_document("gapless", version().version, state.config))
        )
        self.routes: dict[str, dict[str, Handler]] = {
            "/v1/completions": {"POST": self._completions},
            "/v1/chat/completions": {"POST": self._chat},
            "/v1/embeddings": {"POST": partial(handle_embeddings, state)},
            "/v1/responses": {"POST": partial(handle_responses, state)},
            "/v1/models": {"GET": self._models},
            "/health": {"GET": self._health},
            "/live": {"GET": self._live},
            "/openapi.json": {"GET": self._openapi_json},
            "/v1/engine/stats": {"GET": self._engine_stats},
            "/v1/engine/timeline": {"GET": self._engine_timeline},
            "/reset_prefix_cache": {"POST": self._reset_prefix_cache},
            "/metrics": {"GET": self._metrics},
            "/tokenize": {"POST": self._tokenize},
            "/detokenize": {"POST": self._detokenize},
            "/version": {"GET": self._version},
        }
        if state.config.lora_dirs:  # loading adapters at run time (docs/lora.md)
            self.routes["/v1/load_lora_adapter"] = {"POST": self._load_lora}
            self.routes["/v1/unload_lora_adapter"] = {"POST": self._unload_lora}
        self._version_body = version()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        started = time.perf_counter()
        req = HttpRequest(scope, receive)
        extensions = scope.get("extensions") or {}
        out = Responder(
            send, [(b"x-request-id", req.request_id.encode())], extensions.get(CHUNK_WRITER)
        )
        try:
            await self._route(req, out)
        except ApiError as exc:
            if 400 <= exc.status < 500:
                metrics.observer.rejected(exc.code or "invalid_request")
            await out.error(exc)
        except ClientGone:
            pass
        except Exception:
            log.exception("request %s %s failed", req.method, req.path)
            await out.error(
                ApiError(500, "internal error while handling the request", code="internal_error")
            )
        finally:
            _access_line(req, out, time.perf_counter() - started)

    async def _route(self, req: HttpRequest, out: Responder) -> None:
        caller = (
            ANONYMOUS
            if req.path in self._open
            else self._keys.authorize(req.headers.get("authorization", ""))
        )
        methods = self.routes.get(req.path)
        if methods is None and req.path.startswith(MODEL_PREFIX):
            methods = {"GET": self._model}
        if methods is None and req.path.startswith(RESPONSE_PREFIX):
            stored = partial(handle_stored, self.state)
            items = req.path.endswith("/input_items")
            methods = {"GET": stored} if items else {"GET": stored, "DELETE": stored}
        if methods is None:
            raise ApiError(404, f"no route for {req.path}", code="not_found")
        handler = methods.get(req.method)
        if handler is None:
            allow = ", ".join(sorted(methods)).encode()
            raise ApiError(
                405,
                f"{req.method} is not allowed on {req.path}",
                code="method_not_allowed",
                headers=[(b"allow", allow)],
            )
        await handler(req, out, caller)

    async def _completions(self, req: HttpRequest, out: Responder, caller: Caller) -> None:
        await handle_completions(self.state, req, out, caller)

    async def _chat(self, req: HttpRequest, out: Responder, caller: Caller) -> None:
        await handle_chat(self.state, req, out, caller)

    async def _models(self, req: HttpRequest, out: Responder, caller: Caller) -> None:
        """The served model, then each LoRA adapter the caller may name (common/lora.py)."""
        config = self.state.config
        loaded = visible_adapters(config, caller.tenant, self.state.engine.lora_names)
        names = [config.served_model_name, *loaded]
        await out.json(200, ModelList(data=[self._card(name) for name in names]))

    async def _model(self, req: HttpRequest, out: Responder, caller: Caller) -> None:
        """GET /v1/models/{id}: the served model's card or a visible adapter's, else 404."""
        config = self.state.config
        name = unquote(req.path[len(MODEL_PREFIX) :])
        loaded = visible_adapters(config, caller.tenant, self.state.engine.lora_names)
        if name != config.served_model_name and name not in loaded:
            raise ApiError(
                404, f"the model `{name}` does not exist", param="model", code="model_not_found"
            )
        await out.json(200, self._card(name))

    def _card(self, name: str) -> ModelCard:
        config = self.state.config
        parent = None if name == config.served_model_name else config.served_model_name
        return ModelCard(id=name, created=self._created, max_model_len=config.model.max_model_len,
                         family=config.model.architecture, parent=parent)  # fmt: skip

    async def _tokenize(self, req: HttpRequest, out: Responder, caller: Caller) -> None:
        await handle_tokenize(self.state, req, out)

    async def _detokenize(self, req: HttpRequest, out: Responder, caller: Caller) -> None:
        await handle_detokenize(self.state, req, out)

    async def _version(self, req: HttpRequest, out: Responder, caller: Caller) -> None:
        await out.json(200, self._version_body)

    async def _health(self, req: HttpRequest, out: Responder, caller: Caller) -> None:
        engine = self.state.engine
        silent_s = engine.core_silent_s()
        if not engine.healthy:
            await out.json(503, Health("dead", engine.dead_reason))
        elif silent_s > HEARTBEAT_TIMEOUT_S:
            reason = f"the engine core has not answered for {silent_s:.1f} s"
            await out.json(503, Health("unresponsive", reason))
        elif stalled := engine.stalled():
            await out.json(503, Health("stalled", stalled))
        elif self.state.admission.draining:
            await out.json(503, Health("draining", "shutting down; in-flight requests finish"))
        else:
            await out.json(200, Health("ok"))

    async def _live(self, req: HttpRequest, out: Responder, caller: Caller) -> None:
        """Liveness, apart from readiness (/health): 200 while the server loads, serves and
        drains, so that a probe never restarts a pod finishing its work; 503 once the engine
        is dead (serve exits soon after)."""
        engine = self.state.engine
        if not engine.healthy:
            await out.json(503, Health("dead", engine.dead_reason))
        else:
            await out.json(200, Health("alive"))

    async def _reset_prefix_cache(self, req: HttpRequest, out: Responder, caller: Caller) -> None:
        """Every replica forgets its cached prefixes (routers hear AllBlocksCleared); 409 from
        a replica where requests hold KV blocks, which keeps its cache."""
        _check_admin(caller, req.path)
        engine = self.state.engine
        asks = [engine.reset_prefix_cache(k) for k in range(engine.num_replicas)]
        done = [r.done for r in await _from_engine(asyncio.gather(*asks))]
        if not all(done):
            raise ApiError(409, f"replicas {[k for k, d in enumerate(done) if not d]} hold "
                           "requests' KV blocks; reset when idle", code="engine_busy")  # fmt: skip
        await out.json(200, {"reset": done})

    async def _load_lora(self, req: HttpRequest, out: Responder, caller: Caller) -> None:
        """Every replica loads the adapter (frontend/api/lora_routes.py)."""
        _check_admin(caller, req.path)
        name, path = await lora_routes.read_load(self.state, req)
        answers = await _from_engine(self.state.engine.load_lora(name, path, LORA_TIMEOUT_S))
        await lora_routes.answer(out, answers, f"LoRA adapter '{name}' added successfully.")

    async def _unload_lora(self, req: HttpRequest, out: Responder, caller: Caller) -> None:
        """Every replica unloads the adapter: its running requests finish, its waiting ones
        end with an error naming it."""
        _check_admin(caller, req.path)
        name = await lora_routes.read_unload(self.state, req)
        answers = await _from_engine(self.state.engine.unload_lora(name, LORA_TIMEOUT_S))
        await lora_routes.answer(out, answers, f"LoRA adapter '{name}' removed successfully.")

    async def _engine_stats(self, req: HttpRequest, out: Responder, caller: Caller) -> None:
        """A core's queues and KV blocks right now (replica 0's, or `?replica=K`'s)."""
        _check_admin(caller, req.path)
        query = parse_qs(req.scope.get("query_string", b"").decode("latin-1"))
        replica = self._replica(query)
        stats = await _from_engine(self.state.engine.get_stats(timeout_s=2.0, replica=replica))
        await out.json(
            200,
            {
                "replica": replica,
                "num_replicas": self.state.engine.num_replicas,
                "num_running": stats.num_running,
                "num_waiting": stats.num_waiting,
                "num_free_blocks": stats.num_free_blocks,
                "num_total_blocks": stats.num_total_blocks,
                "prefix_cache": {
                    "num_cached_blocks": stats.num_cached_blocks,
                    "num_cached_free_blocks": stats.num_cached_free_blocks,
                    "queried_tokens": stats.prefix_queried_tokens,
                    "hit_tokens": stats.prefix_hit_tokens,
                    "evictions": stats.prefix_evictions,
                },
            },
        )

    def _replica(self, query: dict[str, list[str]]) -> int:
        """The `replica` query parameter: which engine replica answers (0 when left out)."""
        return _query_int(query, "replica", 0, self.state.engine.num_replicas - 1, digits=3)

    async def _engine_timeline(self, req: HttpRequest, out: Responder, caller: Caller) -> None:
        """The device timeline of the last `last` steps (default 256) and idle totals, of
        replica 0 or `?replica=K`."""
        _check_admin(caller, req.path)
        query = parse_qs(req.scope.get("query_string", b"").decode("latin-1"))
        last = _query_int(query, "last", 256, KEEP_STEPS, digits=6)
        replica = self._replica(query)
        timeline = await _from_engine(self.state.engine.get_timeline(last, replica=replica))
        await out.json(
            200,
            {
                "replica": replica,
                "num_replicas": self.state.engine.num_replicas,
                "device": timeline.device,
                "overlap": timeline.overlap,
                "steps": timeline.steps,
                "summary": timeline.summary,
            },
        )

    async def _metrics(self, req: HttpRequest, out: Responder, caller: Caller) -> None:
        """Prometheus text format, merged over every process of the engine; a tenant's key
        reads only its own tenant's series (core_metrics.TENANT_VISIBLE)."""
        tenant = None if caller.admin else caller.tenant
        # why a thread: rendering reads every process's files
        text = await asyncio.get_running_loop().run_in_executor(
            None, core_metrics.render, None, self.state.config.served_model_name, tenant
        )
        await out.raw(200, text, CONTENT_TYPE_PLAIN_0_0_4.encode())

    async def _openapi_json(self, req: HttpRequest, out: Responder, caller: Caller) -> None:
        await out.json(200, self._openapi)


def _query_int(query: dict[str, list[str]], name: str, default: int, top: int, digits: int) -> int:
    """A query parameter that is an integer from 0 to top (default when left out); a 400
    naming it otherwise."""
    raw = query.get(name, [str(default)])[-1]
    # ascii digits (not "²"), at most `digits` of them before int() reads them
    if len(raw) > digits or not raw.isascii() or not raw.isdigit() or int(raw) > top:
        raise ApiError(400, f"`{name}` must be an integer from 0 to {top}", param=name)
    return int(raw)


def _access_line(req: HttpRequest, out: Responder, duration_s: float) -> None:
    """One line per request; probes and scrapes only at debug level."""
    level = logging.DEBUG if req.path in OPEN_PATHS else logging.INFO
    if not access_log.isEnabledFor(level):
        return
    stats = req.stats
    fields = {
        "request_id": req.request_id,
        "method": req.method,
        "route": req.path,
        # 499: the client went away before a response started
        "status": out.status or 499,
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "ttft_ms": None if stats.ttft_s is None else round(stats.ttft_s * 1000, 1),
        "duration_ms": round(duration_s * 1000, 1),
        "finish_reason": stats.finish_reason,
    }
    access_log.log(level, "access", extra={"fields": fields})


def _check_admin(caller: Caller, path: str) -> None:
    """403 unless the caller may read the engine's state (every tenant's traffic)."""
    if not caller.admin:
        raise ApiError(
            403,
            f"{path} needs the admin key (--admin-api-key, or a keys-file entry with "
            '"admin": true)',
            code="admin_key_required",
        )


async def _from_engine(question: Awaitable[T]) -> T:
    """The core's answer, or 503 when the engine is dead or does not answer in time."""
    try:
        return await question
    except (EngineDeadError, TimeoutError) as e:
        raise ApiError(503, f"engine unavailable: {e}", code="engine_unavailable") from e


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
