"""One stream object per request: its counters, its two writers and its end, and the shared
prelude that builds SamplingParams once the output budget is known."""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import pytest

from gapless.common.messages import Abort, CoreInput, SamplingParams, TextDelta, TextDeltas
from gapless.frontend.api.replies import Usage
from gapless.frontend.api.stream import RequestStream
from gapless.frontend.engine.client import EngineClient, StreamCut
from gapless.frontend.http.errors import ApiError
from tests.frontend.conftest import MAX_MODEL_LEN
from tests.frontend.fake_engine import FakeEngine, request_stream

pytestmark = pytest.mark.anyio

PARAMS = SamplingParams(max_tokens=8)


class _Chunks:
    """A ChunkFormat whose chunks name their choice and text; the usual one is plain."""

    def opening(self, index: int, first: TextDelta) -> bytes | None:
        return f"{index}:open".encode()

    def plain(self, index: int, delta: TextDelta) -> bytes | None:
        return None if delta.finish_reason is not None else f"{index}:{delta.text}".encode()

    def delta(self, index: int, delta: TextDelta) -> bytes | None:
        plain = self.plain(index, delta)
        return (
            plain if plain is not None else f"{index}:{delta.text}|{delta.finish_reason}".encode()
        )

    def usage(self, usage: Usage) -> bytes:
        return b"usage"


class _Out:
    """A Responder's event writes: `handler` through `event`, `listener` through `event_now`
    (taken only while `takes_now`)."""

    def __init__(self) -> None:
        self.handler: list[bytes] = []
        self.listener: list[bytes] = []
        self.takes_now = True

    async def event(self, payload: bytes) -> None:
        self.handler.append(payload)

    def event_now(self, payload: bytes) -> bool:
        if self.takes_now:
            self.listener.append(payload)
        return self.takes_now


def _client() -> tuple[EngineClient, list[CoreInput]]:
    sent: list[CoreInput] = []
    return EngineClient(3, sent.append), sent


def _delta(rid: str, n: int, finish: str | None = None) -> TextDelta:
    return TextDelta(rid, f"t{n}", [n], 2, n, finish, num_cached_tokens=1 if finish else 0)


def _sse(stream: RequestStream, out: _Out) -> asyncio.Future[None]:
    """The handler's loop of generation.sse, as a task."""
    stream.write_to(_Chunks(), out)  # type: ignore[arg-type]

    async def run() -> None:
        async for index, delta, received in stream.deltas():
            await stream.write(index, delta, received)

    return asyncio.ensure_future(run())


async def test_each_delta_is_counted_once_whoever_writes_it() -> None:
    client, sent = _client()
    stream = request_stream(client, "s", [1, 2], [PARAMS, PARAMS])
    out = _Out()
    handler = _sse(stream, out)
    await asyncio.sleep(0)
    client.dispatch(TextDeltas([_delta("s-0", 1), _delta("s-1", 1)]))
    await asyncio.sleep(0)
    assert out.handler == [b"0:open", b"0:t1", b"1:open", b"1:t1"] and not out.listener
    client.dispatch(TextDeltas([_delta("s-0", 2)]))  # one choice's usual delta
    client.dispatch(TextDeltas([_delta("s-1", 2)]), flush=False)  # held ...
    client.dispatch(TextDeltas([_delta("s-1", 3)]))  # ... and joined with this one
    assert out.listener == [b"0:t2", b"1:t2t3"], "written without waking the handler"
    assert stream.outputs == [2, 3] and len(out.handler) == 4
    out.takes_now = False  # the connection asks to wait: the handler writes it
    client.dispatch(TextDeltas([_delta("s-0", 3)]))
    await asyncio.sleep(0)
    assert out.handler[-1] == b"0:t3" and len(out.listener) == 2
    client.dispatch(TextDeltas([_delta("s-0", 4, "stop"), _delta("s-1", 4, "length")]))
    await handler
    assert out.handler[-2:] == [b"0:t4|stop", b"1:t4|length"]
    assert stream.outputs == [4, 4] and stream.ended == [True, True]
    assert stream.usage().completion_tokens == 8
    usage = stream.usage()
    assert usage.prompt_tokens == 2 and usage.prompt_tokens_details.cached_tokens == 1
    job = stream.job
    assert (job.stats.completion_tokens, job.stats.finish_reason) == (8, "length")
    assert not client._queues and not [m for m in sent if isinstance(m, Abort)]
    assert stream.tokens_waiting() == 0


async def test_the_listener_writes_nothing_before_the_handler_opened_a_choice() -> None:
    client, _ = _client()
    stream = request_stream(client, "o", [1], [PARAMS])
    out = _Out()
    handler = _sse(stream, out)
    await asyncio.sleep(0)
    assert not stream.write_now(0, _delta("o-0", 1), 0.0), "no token yet"
    client.dispatch(TextDeltas([_delta("o-0", 1)]))
    await asyncio.sleep(0)
    assert out.handler == [b"0:open", b"0:t1"] and stream.started and stream.opened == [True]
    client.dispatch(TextDeltas([_delta("o-0", 2, "stop")]))  # a last delta: the handler's
    await handler
    assert out.handler[-1] == b"0:t2|stop" and not out.listener


async def test_a_failed_end_raises_its_error_counts_nothing_and_aborts_nothing() -> None:
    client, sent = _client()
    job = request_stream(client, "f", [1], [PARAMS, PARAMS]).job
    refused = ApiError(500, "the engine failed", code="engine_error")
    stream = RequestStream(client, job, lambda d: refused if d.finish_reason == "error" else None)
    deltas = stream.deltas()
    first = asyncio.ensure_future(anext(deltas))
    await asyncio.sleep(0)
    client.dispatch(TextDeltas([_delta("f-1", 1)]))
    assert (await first)[0] == 1
    failed = TextDelta("f-0", "", [], 2, 5, "error", None, "boom")
    client.dispatch(TextDeltas([failed]))
    with pytest.raises(ApiError) as raised:
        await anext(deltas)
    assert raised.value is refused
    assert stream.outputs == [0, 1] and stream.reason is None
    assert job.stats.completion_tokens == 1 and job.ticket.num_queued == 0
    assert sent[-1] == Abort(["f-1"]), "the failed choice ended in the engine already"
    assert not client._queues


async def test_a_cut_ends_each_running_choice_with_its_last_chunk() -> None:
    client, _ = _client()
    stream = request_stream(client, "c", [1, 2, 3], [PARAMS] * 3)
    out = _Out()
    handler = _sse(stream, out)
    await asyncio.sleep(0)
    client.dispatch(TextDeltas([_delta("c-0", 1), _delta("c-1", 1, "stop")]))
    await asyncio.sleep(0)
    assert client.cut_all("drained") == ["c"]
    with pytest.raises(StreamCut):
        await handler
    # c-0 opened and runs, c-1 ended, c-2 never opened
    assert stream.last_chunks() == [b"0:|abort", b"2:open", b"2:|abort"]


async def test_tokens_waiting_for_the_handler_are_counted() -> None:
    client, _ = _client()
    stream = request_stream(client, "w", [1], [PARAMS])
    deltas = stream.deltas()
    first = asyncio.ensure_future(anext(deltas))
    await asyncio.sleep(0)
    client.dispatch(TextDeltas([_delta("w-0", 1)]))
    await first  # the handler took one and does not come back for more yet
    for n in (2, 3):
        client.dispatch(TextDeltas([TextDelta("w-0", "ab", [n, n], 2, 2 * n)]))
    assert stream.tokens_waiting() == 4
    await deltas.aclose()
    assert stream.tokens_waiting() == 0 and not client._queues


async def test_sampling_params_are_built_once_with_the_budget(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    """No max_tokens on chat: the rest of the context once the prompt is tokenized, in every
    choice's SamplingParams; min_tokens is judged against the budget asked."""
    messages = [{"role": "user", "content": "one two three"}]
    body = {"messages": messages, "n": 2, "seed": 5, "min_tokens": 1}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    first, second = engine.added
    assert first.params.max_tokens == MAX_MODEL_LEN - len(first.prompt_token_ids)
    assert first.params == msgspec.structs.replace(second.params, seed=5)
    assert (second.params.seed, second.params.min_tokens) == (6, 1)
    too_many = {"messages": messages, "max_completion_tokens": 2, "min_tokens": 3}
    r = await client.post("/v1/chat/completions", json=too_many)
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    assert "max_completion_tokens (2)" in r.json()["error"]["message"]
