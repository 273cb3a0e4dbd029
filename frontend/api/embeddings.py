"""POST /v1/embeddings.

Each input is one engine request with SamplingParams.pooling: prompt-only work through the
same scheduler (chunked, admitted, charged to its tenant; no prefix-cache hit and no KV kept,
core/prefix.py). The runner pools the final hidden state as the checkpoint asks
(frontend/api/embedding_setup.py) and sends it back with the one token it samples (max_tokens 1,
greedy), which is dropped here. Normalizing and Matryoshka truncation happen here, on float32.

Texts are tokenized as sentence-transformers does: with the special tokens the tokenizer's
post-processor adds (add_special_tokens=True), in a thread off the event loop. Token-id inputs
are taken as given.
"""

from __future__ import annotations

import asyncio
import base64
import math
import time
from contextlib import aclosing
from functools import partial
from typing import Any, Literal

import msgspec
import numpy as np

from gapless.common.config import EngineConfig
from gapless.common.messages import SamplingParams
from gapless.frontend.api.embedding_setup import EmbeddingSetup, embedding_setup
from gapless.frontend.api.generation import engine_errors, failure
from gapless.frontend.api.openai_fields import check_fields, struct_fields
from gapless.frontend.api.params import check_model
from gapless.frontend.api.state import FrontendState
from gapless.frontend.api.stream import Job, RequestStream
from gapless.frontend.engine.tenants import Caller, priority_of, tenant_of
from gapless.frontend.http import metrics
from gapless.frontend.http.asgi import HttpRequest, Responder, unless_disconnected
from gapless.frontend.http.errors import ApiError, bad_request, decode_body

EMBEDDINGS_PATH = "/v1/embeddings"
MAX_INPUTS = 2048  # as OpenAI's API
EmbeddingInput = str | list[int | str | list[int]]


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """A text, a list of texts, one list of token ids, or a list of token-id lists."""

    input: EmbeddingInput
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None
    user: str | None = None
    # engine extra, as on the generation routes
    priority: int | str | None = None


class Embedding(msgspec.Struct):
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(msgspec.Struct):
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    object: str = "list"


def embedding_types() -> list[type]:
    """The route's request and answer, for /openapi.json."""
    return [EmbeddingRequest, EmbeddingList]


def embedding_rules(schema: dict[str, Any], ids: dict[str, Any], config: EngineConfig) -> None:
    """EmbeddingRequest's schema (openapi) as this server checks it: `input`'s shapes, none
    empty, ids of the vocabulary (`ids`: their array schema), fewer than the context holds, at
    most MAX_INPUTS; `dimensions` only as the served model's Matryoshka sizes allow."""
    text = {"type": "string", "minLength": 1}
    one = {**ids, "minItems": 1, "maxItems": config.model.max_model_len - 1}
    batch = {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS}
    props = schema["properties"]
    props["input"] = {"anyOf": [text, one, {**batch, "items": {"anyOf": [text, one]}}]}
    setup = embedding_setup(config.model.path)
    sizes: dict[str, Any] = {"type": "null"}  # no Matryoshka sizes: only null
    if setup.matryoshka:
        sizes = {"anyOf": [{"enum": list(setup.matryoshka)}, sizes]}
    elif setup.matryoshka is not None:
        top = {"maximum": setup.hidden_size} if setup.hidden_size else {}
        sizes = {"anyOf": [{"type": "integer", "minimum": 1, **top}, sizes]}
    props["dimensions"] = sizes


_decoder = msgspec.json.Decoder(EmbeddingRequest)
_KNOWN = struct_fields(EmbeddingRequest)


def split_inputs(value: EmbeddingInput) -> list[str | list[int]]:
    """The inputs a request carries; a 400 naming `input` for none, too many or a mix."""
    if isinstance(value, str):
        inputs: list = [value]
    elif value and all(isinstance(x, int) for x in value):
        inputs = [value]
    elif any(isinstance(x, int) for x in value):
        raise bad_request("input mixes token ids with strings or lists", param="input")
    else:
        inputs = list(value)
    if not inputs:
        raise bad_request("input must not be empty", param="input")
    if len(inputs) > MAX_INPUTS:
        raise bad_request(f"input holds {len(inputs)} inputs; at most {MAX_INPUTS}", param="input")
    for x in inputs:
        if not x:
            raise bad_request("input must not hold an empty string or list", param="input")
    return inputs


def check_dimensions(dimensions: int | None, setup: EmbeddingSetup) -> None:
    if dimensions is None:
        return
    if setup.matryoshka is None:
        raise bad_request(
            "dimensions: the served model declares no Matryoshka dimensions, so its "
            "embeddings cannot be shortened",
            param="dimensions",
        )
    top = setup.hidden_size
    allowed = setup.matryoshka
    if dimensions < 1 or (top and dimensions > top) or (allowed and dimensions not in allowed):
        sizes = ", ".join(map(str, allowed)) if allowed else f"1 to {top}"
        raise bad_request(f"dimensions must be one of {sizes}", param="dimensions")


class Tokenize:
    """Inputs to token ids within the context (a 400 naming `input` beyond)."""

    def __init__(self, state: FrontendState) -> None:
        self.prompter = state.prompter
        self.model = state.config.model

    async def __call__(self, inputs: list[str | list[int]]) -> list[list[int]]:
        limit, vocab = self.model.max_model_len, self.model.vocab_size
        texts = [x for x in inputs if isinstance(x, str)]
        for text in texts:
            if len(text) > self.prompter.max_chars:
                raise _too_long(f"{len(text)} characters", limit)
        encoded = iter(await self._encode(texts) if texts else [])
        out: list[list[int]] = []
        for x in inputs:
            ids = next(encoded) if isinstance(x, str) else x
            # why below the limit: the request samples one token after its prompt
            if len(ids) >= limit:
                raise _too_long(f"{len(ids)} tokens", limit)
            if not isinstance(x, str) and not all(0 <= i < vocab for i in x):
                raise bad_request(
                    f"input holds a token id outside the vocabulary [0, {vocab})", param="input"
                )
            out.append(ids)
        return out

    async def _encode(self, texts: list[str]) -> list[list[int]]:
        t0 = time.perf_counter()
        encode = self.prompter.tokenizer.encode_batch_fast
        # why a thread: encode_batch_fast releases the GIL; the event loop goes on meanwhile
        done = await asyncio.get_running_loop().run_in_executor(None, encode, texts, False, True)
        metrics.observer.tokenized(time.perf_counter() - t0)
        return [e.ids for e in done]


def _too_long(size: str, limit: int) -> ApiError:
    return bad_request(
        f"an input is {size}; each must be shorter than the context length of {limit} tokens",
        param="input",
        code="context_length_exceeded",
    )


def finish_vector(raw: bytes, setup: EmbeddingSetup, dimensions: int | None) -> np.ndarray:
    """The pooled float32 vector, truncated to `dimensions` (Matryoshka) and L2-normalized
    where the checkpoint asks (always after a truncation, as sentence-transformers does)."""
    vec = np.frombuffer(raw, dtype="<f4")
    if dimensions is not None:
        vec = vec[:dimensions]
    if setup.normalize or dimensions is not None:
        norm = float(np.linalg.norm(vec))
        vec = vec / max(norm, 1e-12)
    return vec.astype("<f4", copy=False)


def encode_vector(vec: np.ndarray, fmt: str | None) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(vec.astype("<f4", copy=False).tobytes()).decode("ascii")
    return vec.tolist()


async def collect_vectors(stream: RequestStream) -> list[bytes]:
    """Each input's pooled vector, in input order."""
    vectors = [b""] * len(stream.ids)
    async with aclosing(stream.deltas()) as deltas:
        async for index, delta, _ in deltas:
            if delta.embedding is not None:
                vectors[index] = delta.embedding
    for i, vec in enumerate(vectors):
        if not vec:
            raise ApiError(500, f"the engine sent no vector for input {i}", code="engine_error")
    return vectors


async def handle_embeddings(
    state: FrontendState, req: HttpRequest, out: Responder, caller: Caller
) -> None:
    arrival = time.time()
    config = state.config
    raw = await req.body(config.max_body_bytes)
    received = time.perf_counter()
    body = decode_body(_decoder, raw)
    check_fields(raw, "embeddings", _KNOWN, {})
    check_model(body.model, config)
    setup = embedding_setup(config.model.path)
    check_dimensions(body.dimensions, setup)
    inputs = split_inputs(body.input)
    tenant = tenant_of(caller, req.headers.get("x-tenant"), body.user)
    priority = priority_of(body.priority, tenant, config)
    params = SamplingParams(max_tokens=1, temperature=0.0, pooling=setup.pooling)
    with state.admission.admit(tenant, len(inputs), received) as ticket:
        prompts = await Tokenize(state)(inputs)
        total = sum(map(len, prompts))
        cap = config.max_queued_tokens
        if cap is not None and total > cap:
            raise ApiError(
                413,
                f"input holds {total} tokens; one request may hold at most {cap} "
                "(--max-queued-tokens)",
                param="input",
                code="request_too_large",
            )
        # the admission count takes one size per choice: the mean input
        state.admission.admit_tokens(ticket, math.ceil(total / len(prompts)), received)
        job = Job(
            "embeddings",
            state.engine.next_request_id(),
            prompts,
            [params] * len(prompts),
            tenant,
            priority,
            arrival,
            ticket,
            label=req.request_id,
            stats=req.stats,
            num_prompt_tokens=total,
        )
        vectors = await _run(state, job, req)
    job.stats.completion_tokens = 0  # the token each input sampled is not an output
    data = [
        Embedding(i, encode_vector(finish_vector(v, setup, body.dimensions), body.encoding_format))
        for i, v in enumerate(vectors)
    ]
    usage = EmbeddingUsage(total, total)
    await out.json(200, EmbeddingList(data, config.served_model_name, usage))


async def _run(state: FrontendState, job: Job, req: HttpRequest) -> list[bytes]:
    """The engine's vectors; a client that disconnects first aborts the engine requests."""
    stream = RequestStream(state.engine, job, partial(failure, admission=state.admission))
    with engine_errors(job):
        return await unless_disconnected(req.receive, collect_vectors(stream))
