from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import msgspec
import pytest
import zmq
import zmq.asyncio

from gapless.common.channel import AsyncReceiver, Sender
from gapless.common.messages import (
    Abort,
    AddRequest,
    CoreInput,
    EngineDead,
    EngineStats,
    FrontendInput,
    GetStats,
    SamplingParams,
    TextDelta,
    TextDeltas,
    TokenLogprob,
)
from gapless.common.process import CORE_IN, frontend_socket
from gapless.frontend.engine.client import (
    EngineClient,
    EngineDeadError,
    StreamCut,
    ZmqEngineClient,
)
from gapless.frontend.engine.inbox import Inbox
from tests.frontend.fake_engine import request_stream

PARAMS = SamplingParams(max_tokens=4)


def _client() -> tuple[EngineClient, list[CoreInput]]:
    sent: list[CoreInput] = []
    return EngineClient(3, sent.append), sent


def _delta(rid: str, n: int, finish: str | None = None) -> TextDelta:
    return TextDelta(rid, f"t{n}", [n], 2, n, finish)


def _deltas(client: EngineClient, rid: str, prompt: list[int], params, **kw):
    """The (index, delta, received) of one request's stream (RequestStream.deltas)."""
    return request_stream(client, rid, prompt, params, **kw).deltas()


async def _one(client: EngineClient, rid: str, prompt: list[int], params: SamplingParams):
    """One choice's deltas alone; closing this closes its stream."""
    stream = _deltas(client, rid, prompt, [params])
    try:
        async for _, delta, _ in stream:
            yield delta
    finally:
        await stream.aclose()


@pytest.mark.anyio
async def test_a_stream_merges_choices_and_cleans_up() -> None:
    client, sent = _client()
    rid = client.next_request_id()
    assert rid == "3-0" and client.next_request_id() == "3-1"
    stream = _deltas(client, rid, [1, 2], [PARAMS, PARAMS], tenant="t", priority=0)
    first = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)
    assert [m.request_id for m in sent] == ["3-0-0", "3-0-1"]  # type: ignore[union-attr]
    assert all(isinstance(m, AddRequest) and m.tenant == "t" and m.priority == 0 for m in sent)
    client.dispatch(TextDeltas([_delta("3-0-1", 1), _delta("other", 1), _delta("3-0-0", 1)]))
    client.dispatch(TextDeltas([_delta("3-0-0", 2, "stop"), _delta("3-0-1", 2, "length")]))
    got = [await first] + [x async for x in stream]
    # the consumer read nothing until both steps were in: one delta per choice, joined in order
    got = [(i, d.text, d.token_ids, d.num_output_tokens, d.finish_reason) for i, d, _ in got]
    assert got == [
        (1, "t1t2", [1, 2], 2, "length"),
        (0, "t1t2", [1, 2], 2, "stop"),
    ]
    assert not client._queues and len(sent) == 2  # no Abort after a full finish


@pytest.mark.anyio
async def test_a_consumer_that_keeps_up_gets_every_delta() -> None:
    client, _ = _client()
    stream = _deltas(client, "k", [1], [PARAMS])
    got = []
    for n in range(1, 4):
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        client.dispatch(TextDeltas([_delta("k-0", n, "stop" if n == 3 else None)]))
        got.append((await task)[1].text)
    assert got == ["t1", "t2", "t3"]


@pytest.mark.anyio
async def test_a_consumer_behind_gets_what_waited_joined_with_logprobs() -> None:
    client, _ = _client()
    stream = _deltas(client, "b", [1], [PARAMS])
    task = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)
    lp = [TokenLogprob(f"t{n}", -float(n), n) for n in range(1, 4)]
    client.dispatch(TextDeltas([msgspec.structs.replace(_delta("b-0", 1), logprobs=lp[:1])]))
    client.dispatch(TextDeltas([msgspec.structs.replace(_delta("b-0", 2), logprobs=lp[1:2])]))
    client.dispatch(
        TextDeltas([msgspec.structs.replace(_delta("b-0", 3, "length"), logprobs=lp[2:])])
    )
    _, delta, _ = await task
    assert (delta.text, delta.token_ids, delta.num_output_tokens) == ("t1t2t3", [1, 2, 3], 3)
    assert delta.finish_reason == "length" and delta.logprobs == lp
    assert [d async for d in stream] == []


@pytest.mark.anyio
async def test_deltas_before_the_engine_died_are_delivered_then_the_error() -> None:
    client, _ = _client()
    stream = _deltas(client, "d", [1], [PARAMS])
    task = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)
    client.dispatch(TextDeltas([_delta("d-0", 1)]))
    client.dispatch(EngineDead("gone"))
    assert (await task)[1].text == "t1"
    with pytest.raises(EngineDeadError):
        await stream.__anext__()


@pytest.mark.anyio
async def test_leaving_early_aborts_the_unfinished() -> None:
    client, sent = _client()
    stream = _deltas(client, "r", [1], [PARAMS] * 3)
    task = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)
    client.dispatch(TextDeltas([_delta("r-1", 1, "stop")]))
    assert (await task)[0] == 1
    await stream.aclose()
    assert sent[-1] == Abort(["r-0", "r-2"])
    assert not client._queues

    # cancellation while waiting (a client disconnect) aborts as well
    async def consume() -> None:
        async for _ in _one(client, "c", [1], PARAMS):
            pass

    task = asyncio.ensure_future(consume())
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert sent[-1] == Abort(["c-0"])


@pytest.mark.anyio
async def test_engine_dead_ends_everything() -> None:
    client, sent = _client()
    dead_reasons: list[str] = []
    client.on_dead(dead_reasons.append)

    async def consume(rid: str) -> list[TextDelta]:
        return [d async for d in _one(client, rid, [1], PARAMS)]

    tasks = [asyncio.ensure_future(consume(f"r{i}")) for i in range(3)]
    stats = asyncio.ensure_future(client.get_stats())
    await asyncio.sleep(0)
    client.dispatch(EngineDead("runner crashed\nTraceback (most recent call last): ..."))
    results = await asyncio.gather(*tasks, stats, return_exceptions=True)
    assert all(isinstance(r, EngineDeadError) and str(r) == "runner crashed" for r in results)
    assert not client.healthy and dead_reasons == ["runner crashed"]  # no traceback for clients
    assert not any(isinstance(m, Abort) for m in sent)  # nobody to tell
    with pytest.raises(EngineDeadError):
        await anext(_one(client, "late", [1], PARAMS))


@pytest.mark.anyio
async def test_get_stats() -> None:
    client, sent = _client()
    task = asyncio.ensure_future(client.get_stats())
    await asyncio.sleep(0)
    (ask,) = sent
    assert isinstance(ask, GetStats) and ask.frontend_id == 3
    client.dispatch(EngineStats(ask.token, 1, 2, 3, 4))
    assert (await task).num_waiting == 2


@asynccontextmanager
async def _zmq_client(config):
    """A ZmqEngineClient of frontend 1 (not started), the core's inbox it sends to and a
    sender to its socket; all closed on the way out."""
    ctx = zmq.Context()
    actx = zmq.asyncio.Context()
    core_in: AsyncReceiver[CoreInput] = AsyncReceiver(actx, config.ipc(CORE_IN), CoreInput)
    client = ZmqEngineClient(config, 1, ctx)
    to_front: Sender[FrontendInput] = Sender(ctx, config.ipc(frontend_socket(1)))
    try:
        yield client, core_in, to_front
    finally:
        await client.close()
        to_front.close()
        core_in.close()
        actx.term()
        ctx.term()


@pytest.mark.anyio
async def test_zmq_engine_client_round_trip(make_config, tmp_path) -> None:
    async with _zmq_client(make_config(run_dir=str(tmp_path))) as (client, core_in, to_front):
        client.start()
        stream = _one(client, "1-0", [5, 6], PARAMS)
        first = asyncio.ensure_future(anext(stream))
        add = await asyncio.wait_for(core_in.recv(), 2)
        assert isinstance(add, AddRequest) and add.request_id == "1-0-0" and add.frontend_id == 1
        to_front.send(TextDeltas([_delta("1-0-0", 1)]))
        assert (await asyncio.wait_for(first, 2)).text == "t1"
        await stream.aclose()
        assert await asyncio.wait_for(core_in.recv(), 2) == Abort(["1-0-0"])
        to_front.send(EngineDead("bye"))
        for _ in range(200):
            if not client.healthy:
                break
            await asyncio.sleep(0.01)
        assert client.dead_reason == "bye"


@pytest.mark.parametrize("batch", [1, 32, 256])
def test_bench_fanout_step(benchmark, batch: int) -> None:
    """One step's TextDeltas (one delta per in-flight request), decoded and fanned out."""
    client, _ = _client()
    loop = asyncio.new_event_loop()
    queues = [Inbox(loop) for _ in range(batch)]
    for i, q in enumerate(queues):
        client._queues[f"3-{i}-0"] = q
    deltas = [TextDelta(f"3-{i}-0", " word", [1234], 100, 7) for i in range(batch)]
    frame = msgspec.msgpack.encode(TextDeltas(deltas))
    decoder = msgspec.msgpack.Decoder(FrontendInput)

    def drain() -> None:
        for q in queues:
            q._deltas.clear()

    def step() -> None:
        client.dispatch(decoder.decode(frame))

    benchmark.pedantic(step, setup=drain, rounds=200, warmup_rounds=5)
    loop.close()
    assert all(len(q) == 1 for q in queues)
    got = [q._deltas[0][0] for q in queues]  # (delta, received) items
    assert [d.request_id for d in got] == [f"3-{i}-0" for i in range(batch)]  # each to its own
    assert all(d.text == " word" and d.token_ids == [1234] for d in got)


@pytest.mark.anyio
async def test_a_backlog_of_frames_reaches_the_streams_in_bursts(make_config, tmp_path) -> None:
    """A frontend that fell behind its socket lets the streams write between bursts of frames,
    so their unsent deltas stay under max_pending: nobody is aborted as a slow reader."""
    config = make_config(run_dir=str(tmp_path), stream_buffer_events=8)
    async with _zmq_client(config) as (client, core_in, to_front):
        stream = _one(client, "1-0", [5, 6], SamplingParams(max_tokens=50))
        first = asyncio.ensure_future(anext(stream))
        await asyncio.wait_for(core_in.recv(), 2)  # the AddRequest
        for n in range(1, 51):  # 50 steps queued on the socket before the listener reads any
            to_front.send(TextDeltas([_delta("1-0-0", n, "length" if n == 50 else None)]))
        await asyncio.sleep(0.2)
        client.start()
        got = [await asyncio.wait_for(first, 2)]
        async for delta in stream:
            got.append(delta)
        assert "".join(d.text for d in got) == "".join(f"t{n}" for n in range(1, 51))
        assert got[-1].finish_reason == "length"
        assert len(got) < 50  # what waited came joined


@pytest.mark.anyio
async def test_a_burst_ending_in_a_malformed_frame_leaves_nothing_held(
    make_config, tmp_path
) -> None:
    """The listener holds a frame's deltas only with the next frame in hand: a dropped frame
    after a burst does not keep the burst's deltas back until some later frame comes."""
    async with _zmq_client(make_config(run_dir=str(tmp_path))) as (client, core_in, to_front):
        written: list[str] = []

        def direct(index: int, delta: TextDelta, received: float) -> bool:
            if written:  # the handler takes the first burst, direct the second
                written.append(delta.text)
            return len(written) > 1

        stream = _deltas(client, "1-0", [5], [PARAMS], direct=direct)
        first = asyncio.ensure_future(anext(stream))
        await asyncio.wait_for(core_in.recv(), 2)  # the AddRequest
        to_front.send(TextDeltas([_delta("1-0-0", 1)]))
        to_front.send(TextDeltas([_delta("1-0-0", 2)]))
        to_front.socket.send(b"\xff not msgpack")
        await asyncio.sleep(0.2)
        client.start()
        assert (await asyncio.wait_for(first, 0.3))[1].text == "t1t2"  # joined, not held
        written.append("")
        waiting = asyncio.ensure_future(anext(stream))  # the handler waits for more
        await asyncio.sleep(0)
        # why one frame: two frames sent while the listener runs may reach it one at a time
        # on a busy machine, and the first would rightly go out alone
        to_front.send(TextDeltas([_delta("1-0-0", 3), _delta("1-0-0", 4)]))
        to_front.socket.send(b"\xff not msgpack")
        for _ in range(30):
            if len(written) > 1:
                break
            await asyncio.sleep(0.01)
        assert written == ["", "t3t4"], "the burst went to direct without waiting for a frame"
        assert not waiting.done()
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)


@pytest.mark.anyio
@pytest.mark.parametrize("direct", [False, True])
async def test_deltas_its_handler_has_not_taken_are_joined_not_cut(direct: bool) -> None:
    """A handler behind its deltas (the event loop is busy) is not judged a slow reader:
    past max_pending, what waits is joined per choice, and every token still arrives."""
    sent: list[CoreInput] = []
    client = EngineClient(3, sent.append, max_pending=4)
    written: list[str] = []

    def decline(index: int, delta: TextDelta, received: float) -> bool:
        written.append(delta.text)
        return False  # as a connection whose client blocks the writes

    stream = _deltas(client, "3-0", [1], [PARAMS], direct=decline if direct else None)
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    for n in range(1, 41):  # the handler does not run meanwhile
        client.dispatch(TextDeltas([_delta("3-0-0", n, "length" if n == 40 else None)]))
        assert len(client._queues["3-0-0"]) <= 5
    assert not [m for m in sent if isinstance(m, Abort)]
    got = [(await first)[1]] + [d async for _, d, _ in stream]
    assert "".join(d.text for d in got) == "".join(f"t{n}" for n in range(1, 41))
    assert [t for d in got for t in d.token_ids] == list(range(1, 41))
    assert got[-1].finish_reason == "length" and got[-1].num_output_tokens == 40
    assert not client._queues


@pytest.mark.anyio
async def test_cut_all_names_each_request_once() -> None:
    client, sent = _client()
    labelled = _deltas(client, "3-0", [1], [PARAMS, PARAMS], label="client-id")
    plain = _deltas(client, "3-1", [1], [PARAMS])
    waits = [asyncio.ensure_future(anext(s)) for s in (labelled, plain)]
    await asyncio.sleep(0)
    assert sorted(client.cut_all("drained")) == ["3-1", "client-id"]
    for wait in waits:
        with pytest.raises(StreamCut):
            await wait
    aborted = sorted(rid for m in sent if isinstance(m, Abort) for rid in m.request_ids)
    assert aborted == ["3-0-0", "3-0-1", "3-1-0"]


@pytest.mark.anyio
async def test_direct_takes_held_deltas_joined_per_choice_and_never_a_last_one() -> None:
    client, _ = _client()
    written: list[tuple[int, str, list[int]]] = []

    def direct(index: int, delta: TextDelta, received: float) -> bool:
        written.append((index, delta.text, delta.token_ids))
        return True

    stream = _deltas(client, "d", [1], [PARAMS, PARAMS], direct=direct)
    consumer = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)  # the consumer waits for its first delta
    client.dispatch(TextDeltas([_delta("d-0", 1)]), flush=False)
    client.dispatch(TextDeltas([_delta("d-0", 2)]))
    assert written == [(0, "t1t2", [1, 2])] and not consumer.done()
    client.dispatch(TextDeltas([_delta("d-1", 1)]))
    assert written[-1] == (1, "t1", [1])
    # deltas of both choices held together: the consumer gets them, each choice joined
    client.dispatch(TextDeltas([_delta("d-0", 3), _delta("d-1", 2)]), flush=False)
    client.dispatch(TextDeltas([_delta("d-0", 4)]))
    assert len(written) == 2
    got = [await consumer]
    got.append(await stream.__anext__())
    assert [(i, d.text) for i, d, _ in got] == [(0, "t3t4"), (1, "t2")]
    consumer = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0)
    client.dispatch(TextDeltas([_delta("d-1", 3, "stop")]))  # a choice's last delta
    assert len(written) == 2
    assert (await consumer)[1].finish_reason == "stop"
    await stream.aclose()
