"""One streaming /v1/completions request, timed per chunk; every failure is recorded, not raised.

The load generator shares the machine with the server it measures, so its cost per event is
part of every figure: aiohttp reads an SSE stream for about 0.6x of httpx's CPU per event (64
streams of 400 events from a local server, client CPU per event: httpx 20-34 us, aiohttp 12-23
us, alternating runs) and connects without a resolver thread. The body is read as bytes as they
arrive (bench/sse.py's SSEStream) and chunks decode into structs of the fields read: reading
line by line with json.loads, the load generator of the host-floor check (128 streams of
128:1024 at ~2 ms steps) used 2.41-2.84 s of CPU a run, 2.06-2.30 s this way (three
alternating runs each, ~0.65 s of it start-up).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from gapless.bench.sse import SSEStream


@dataclass
class RequestRecord:
    prompt_len: int  # tokens sent
    output_len: int  # max_tokens asked for
    ok: bool = False
    error: str | None = None
    start: float = 0.0  # time.perf_counter() at send
    ttft: float | None = None  # s, to the first chunk with text
    itl: list[float] = field(default_factory=list)  # s, between chunks with text
    e2e: float | None = None  # s, send to end of stream
    output_tokens: int = 0  # usage.completion_tokens, else chunks with text
    tenant: str | None = None  # of a multi-tenant run
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if reported
    text: list[str] | None = None  # the output's chunks, kept when a list is given

    @property
    def tpot(self) -> float | None:
        """s per output token after the first."""
        if not self.ok or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def completion_payload(
    model: str,
    prompt: str,
    max_tokens: int,
    *,
    ignore_eos: bool,
    temperature: float,
    eos_token_ids: tuple[int, ...] = (),
    user: str | None = None,
    priority: int | str | None = None,
    cache_salt: str | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
        if eos_token_ids:  # why: servers without ignore_eos (OpenAI's API) honour a logit bias
            body["logit_bias"] = {str(i): -100 for i in eos_token_ids}
    if user is not None:
        body["user"] = user
    if priority is not None:
        body["priority"] = priority
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


def _error_text(body: bytes) -> str:
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        err = None
    if isinstance(err, dict):
        return str(err.get("message") or err)
    if err:
        return str(err)
    return body[:200].decode("utf-8", "replace").strip()


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None  # completions
    delta: _Delta | None = None  # chat completions


class _PromptDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    prompt_tokens_details: _PromptDetails | None = None


class _Chunk(msgspec.Struct):
    """The fields of a streamed chunk that a record needs; the rest are skipped unread."""

    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: Any = None


_chunk_decoder = msgspec.json.Decoder(_Chunk)


def _chunk_text(chunk: _Chunk) -> str:
    parts = []
    for choice in chunk.choices or ():
        text = choice.text
        if text is None and choice.delta is not None:
            text = choice.delta.content
        parts.append(text or "")
    return "".join(parts)


def _read_prompt_usage(usage: _Usage, record: RequestRecord) -> None:
    """Cached prompt tokens, and the prompt's length where the sender did not know it (0)."""
    details = usage.prompt_tokens_details
    if details is not None and details.cached_tokens is not None:
        record.cached_tokens = details.cached_tokens
    if record.prompt_len == 0 and usage.prompt_tokens is not None:
        record.prompt_len = usage.prompt_tokens


async def stream_completion(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    record: RequestRecord,
    headers: dict[str, str] | None = None,
) -> RequestRecord:
    """POSTs `body` to `url` and fills `record` from the SSE stream."""
    record.start = time.perf_counter()
    last = record.start
    chunks, usage_tokens, done = 0, None, False
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {_error_text(await resp.read())}"
                return record
            stream = SSEStream()
            async for data in resp.content.iter_any():  # whatever has arrived
                now = time.perf_counter()
                for event in stream.feed(data):
                    if event.data.strip() == "[DONE]":
                        done = True
                        break
                    chunk = _chunk_decoder.decode(event.data)
                    if event.event == "error" or chunk.error is not None:
                        record.error = f"error event: {_error_text(event.data.encode())}"
                        return record
                    if text := _chunk_text(chunk):
                        chunks += 1
                        if record.text is not None:
                            record.text.append(text)
                        if record.ttft is None:
                            record.ttft = now - record.start
                        else:
                            record.itl.append(now - last)
                        last = now
                    if (usage := chunk.usage) and usage.completion_tokens is not None:
                        usage_tokens = usage.completion_tokens
                        _read_prompt_usage(usage, record)
                if done:
                    break
    except (aiohttp.ClientError, TimeoutError) as exc:
        record.error = f"{type(exc).__name__}: {str(exc) or 'no detail'}"
        return record
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        record.error = f"bad stream event: {exc}"
        return record
    finally:
        record.e2e = time.perf_counter() - record.start
    if not done:
        record.error = "stream ended before [DONE]"
        return record
    record.output_tokens = usage_tokens if usage_tokens is not None else chunks
    record.ok = True
    return record
