from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import tokenizers
import uvicorn
import uvloop
from prometheus_client import CollectorRegistry

from gapless.common.config import EngineConfig, ModelInfo
from gapless.common.metrics import FrontendMetrics
from gapless.frontend.api.prompts import Prompter
from gapless.frontend.api.responses_store import open_store
from gapless.frontend.api.state import FrontendState
from gapless.frontend.app import App
from gapless.frontend.engine.admission import Admission
from gapless.frontend.http import metrics
from gapless.frontend.http.transport import bounded_protocol
from tests.frontend.fake_engine import FakeEngine

MODEL = "smol-test"
MAX_MODEL_LEN = 256


@pytest.fixture(scope="session")
def hf_tokenizer(
    default_gguf: Path, pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory
) -> tuple[tokenizers.Tokenizer, str]:
    """SmolLM2's tokenizer and ChatML template as transformers reads them from the GGUF.

    Loading through transformers takes ~13 s, so its result is kept in pytest's cache (when the
    cache plugin is on), keyed by the GGUF's size and mtime.
    """
    stat = default_gguf.stat()
    key = f"{stat.st_size}-{int(stat.st_mtime)}"
    if getattr(pytestconfig, "cache", None) is not None:
        cache = pytestconfig.cache.mkdir("gapless-frontend-tokenizer")
    else:
        cache = tmp_path_factory.mktemp("tokenizer")
    meta_path, tok_path = cache / "meta.json", cache / "tokenizer.json"
    if meta_path.exists() and tok_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta["key"] == key:
            return tokenizers.Tokenizer.from_file(str(tok_path)), meta["chat_template"]
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(
        str(default_gguf.parent), gguf_file=default_gguf.name
    )
    hf.backend_tokenizer.save(str(tok_path))
    meta_path.write_text(json.dumps({"key": key, "chat_template": hf.chat_template}))
    return hf.backend_tokenizer, hf.chat_template


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def make_config(
    hf_tokenizer: tuple[tokenizers.Tokenizer, str], default_gguf: Path
) -> Callable[..., EngineConfig]:
    """make_config(**overrides) -> EngineConfig; `model_overrides` changes ModelInfo fields."""
    _, template = hf_tokenizer

    def make(model_overrides: dict[str, Any] | None = None, **overrides: Any) -> EngineConfig:
        info = ModelInfo(
            path=str(default_gguf),
            architecture="llama",
            vocab_size=49152,
            max_model_len=MAX_MODEL_LEN,
            eos_token_ids=(2,),
            bos_token_id=1,
            add_bos_token=False,
            chat_template=template,
        )
        info = msgspec.structs.replace(info, **(model_overrides or {}))
        fields = {"served_model_name": MODEL, "max_n": 4, "max_logprobs": 5, **overrides}
        return EngineConfig(model=info, **fields)

    return make


@pytest.fixture
def config(make_config: Callable[..., EngineConfig]) -> EngineConfig:
    return make_config()


@pytest.fixture
def engine(hf_tokenizer: tuple[tokenizers.Tokenizer, str]) -> FakeEngine:
    return FakeEngine(hf_tokenizer[0])


def build_app(config: EngineConfig, engine: FakeEngine) -> App:
    """The app over the fake engine; it keeps responses only where the config names a store
    (never the default file in the model cache)."""
    prompter = Prompter(engine.tokenizer, config)
    store = open_store(config) if config.responses_store else None
    return App(FrontendState(config, engine, prompter, Admission(config, engine), store))


@pytest.fixture
def app(config: EngineConfig, engine: FakeEngine) -> App:
    return build_app(config, engine)


@contextmanager
def served(config: EngineConfig, engine: FakeEngine, send_buffer: int = 0) -> Iterator[int]:
    """The app behind real uvicorn (with the request-head limit) on a free port, in a thread;
    yields the port. `send_buffer` > 0 fixes each connection's kernel send buffer (Linux's
    grows to megabytes, which a client that stops reading takes seconds to fill)."""
    sock = socket.socket()
    if send_buffer:  # accepted connections inherit it
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(config, engine),
            http=bounded_protocol(config),
            timeout_keep_alive=config.keep_alive_timeout_s,  # type: ignore[arg-type]
            lifespan="off",
            log_level="critical",
        )
    )
    # uvloop, as the frontend serves (frontend/server.py); asyncio's own loop would leave Nagle
    # on for this socket's connections (it sets TCP_NODELAY only where the socket names
    # IPPROTO_TCP), and each request would wait ~40 ms for a delayed ACK
    thread = threading.Thread(target=lambda: uvloop.run(server.serve(sockets=[sock])))
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture
async def client(app: App) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    """The frontend's series, observed into a fresh registry for the test."""
    registry = CollectorRegistry()
    metrics.set_observer(metrics.PrometheusObserver(FrontendMetrics(registry)))
    yield registry
    metrics.set_observer(metrics.RequestObserver())


def sse_events(body: str) -> list[Any]:
    """The JSON of every `data:` event, then the literal "[DONE]" if it came."""
    events: list[Any] = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events
