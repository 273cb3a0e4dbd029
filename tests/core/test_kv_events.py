"""KV events as routers read them: decoded with vLLM 0.33.0's own event types (written here from
vllm/distributed/kv_events.py of that release) by the positional-or-map rule of llm-d's and
Dynamo's decoders; replayed into a model of the cache; recovered from the replay socket; never
blocking the step that publishes them."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import zmq

from gapless.common.block_hash import cache_scope
from gapless.common.kv_events import KvEventLog
from gapless.common.messages import AddRequest, PrefixCacheReset, ResetPrefixCache, SamplingParams
from gapless.core.kv_blocks import BlockManager
from gapless.core.kv_publisher import END_SEQ, KvEventPublisher
from tests.conftest import sim_config
from tests.engine_harness import Harness

# vLLM 0.33.0's types, field for field (ExternalBlockHash = bytes | int)
Hash = bytes | int


class VBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(VEvent):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(VEvent):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(VEvent):
    pass


# the same types before 0.26: positional arrays, the tag first
class PBlockStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    lora_name: str | None = None


class PBlockRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None = None


class PAllBlocksCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


MAP = BlockStored | BlockRemoved | AllBlocksCleared
POSITIONAL = PBlockStored | PBlockRemoved | PAllBlocksCleared


def decode_batch(payload: bytes) -> tuple[VBatch, list[Any]]:
    """The outer batch, then each event: an array is positional, a map is tagged by "type"."""
    batch = msgspec.msgpack.decode(payload, type=VBatch)
    events = [msgspec.convert(e, POSITIONAL if isinstance(e, list) else MAP) for e in batch.events]
    return batch, events


class CacheModel:
    """What a router knows of one engine's cache: the set of hashes a lookup can hit."""

    def __init__(self) -> None:
        self.hashes: set[bytes] = set()
        self.stored: list[BlockStored] = []

    def apply(self, event: Any) -> None:
        match event:
            case BlockStored(block_hashes=hs, token_ids=tokens, block_size=bs):
                assert len(tokens) == bs * len(hs) and not self.hashes & set(hs)
                self.hashes |= set(hs)
                self.stored.append(event)
            case BlockRemoved(block_hashes=hs):
                assert set(hs) <= self.hashes, "removed a block never stored"
                self.hashes -= set(hs)
            case AllBlocksCleared():
                self.hashes.clear()


def wire(events: list) -> bytes:
    """One step's events as the publisher encodes them."""
    from gapless.common.kv_events import KvEventBatch

    return msgspec.msgpack.encode(KvEventBatch(time.time(), events, 0))


def small_cache_config(default_gguf, **overrides):
    config = sim_config(default_gguf, max_num_seqs=2, kv_events_endpoint="0", **overrides)
    # 2 seats x 128 tokens: 16 usable blocks of 16, so a few prompts evict each other
    model = msgspec.structs.replace(config.model, max_model_len=128)
    return msgspec.structs.replace(config, model=model)


@pytest.fixture(scope="module")
def run(default_gguf) -> Harness:
    """One engine's life: a workload that hits and evicts, a reset, more of it, then two
    tenants sending one prompt."""
    h = Harness(small_cache_config(default_gguf))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = [[1000 + 100 * i + t for t in range(56)] for i in range(8)]
    order = [0, 1, 0, 2, 3, 0, 4, 5, 6, 1, 7, 0]  # repeats hit; eight distinct ones do not fit
    h.run({3 * k: [(f"a{k}", prompts[i], params)] for k, i in enumerate(order)})
    assert h.scheduler.blocks.num_evictions > 0 and h.scheduler.num_hit_tokens > 0
    h.core.handle(ResetPrefixCache(frontend_id=0, token=7))  # as POST /reset_prefix_cache
    later = enumerate([2, 2, 3, 5])
    h.run({h.steps + 3 * k: [(f"b{k}", prompts[i], params)] for k, i in later})
    for tenant in ("acme", "globex"):
        h.outputs[tenant], h.token_steps[tenant], h.deltas[tenant] = [], [], []
        h.core.handle(
            AddRequest(
                request_id=tenant, frontend_id=0, prompt_token_ids=list(range(2000, 2040)),
                params=SamplingParams(max_tokens=2), arrival_time=time.time(),
                tenant=tenant, cache_salt=cache_scope(tenant, ""),
            )
        )  # fmt: skip
    h.run()
    return h


def decoded(h: Harness) -> list[Any]:
    """Every event the engine sent, through the wire and vLLM 0.33.0's decoder."""
    out = []
    for step in h.kv_events:
        batch, events = decode_batch(wire(step))
        assert batch.data_parallel_rank == 0
        out += events
    return out


def test_replaying_the_events_gives_exactly_the_blocks_the_engine_holds(run):
    model = CacheModel()
    events = decoded(run)
    for event in events:
        model.apply(event)
    assert {type(e).__name__ for e in events} == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    assert type(events[0]).__name__ == "AllBlocksCleared", "the engine starts empty"
    assert model.hashes == set(run.scheduler.blocks._by_hash), "the router sees the engine's cache"
    assert model.hashes, "the workload left blocks cached"
    assert PrefixCacheReset(7, True) in run.frontend
    run.scheduler.blocks.check()
    stored = model.stored[-1]
    assert stored.medium == "GPU" and stored.lora_name is None and stored.block_size == 16


def test_two_tenants_with_one_prompt_give_distinguishable_events(run):
    stored = [e for e in decoded(run) if type(e).__name__ == "BlockStored"]
    firsts = [e for e in stored if e.parent_block_hash is None and e.token_ids[0] == 2000]
    assert len(firsts) == 2 and firsts[0].token_ids == firsts[1].token_ids
    assert firsts[0].block_hashes[0] != firsts[1].block_hashes[0]
    scopes = {e.extra_keys[0] for e in firsts}
    assert scopes == {(cache_scope("acme", ""),), (cache_scope("globex", ""),)}


def test_a_reset_while_a_request_holds_blocks_changes_nothing():
    log = KvEventLog(block_size=4)
    m = BlockManager(num_blocks=4, block_size=4, events=log)
    held = m.allocate(1)
    assert not m.reset() and log.take() == []
    m.free(held)
    assert m.reset() and type(log.take()[0]).__name__ == "AllBlocksCleared"


def test_positional_events_decode_by_the_same_rule():
    payload = msgspec.msgpack.encode(
        [1.5, [["BlockStored", [b"h1"], None, list(range(16)), 16, None, "GPU", None],
               ["BlockRemoved", [b"h1"], "GPU"], ["AllBlocksCleared"]], 0]
    )  # fmt: skip
    _, events = decode_batch(payload)
    assert [type(e).__name__ for e in events] == [
        "PBlockStored", "PBlockRemoved", "PAllBlocksCleared"
    ]  # fmt: skip


def subscribe(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    return sub


def test_a_late_subscriber_gets_the_missed_batches_from_the_replay_socket():
    ctx = zmq.Context()
    pub = KvEventPublisher(ctx, "0", replay_endpoint="0", topic="kv", rank=3)
    try:
        sub = subscribe(ctx, pub.endpoint)
        time.sleep(0.2)  # the subscription reaches the publisher
        from gapless.common.kv_events import AllBlocksCleared as Cleared

        for _ in range(5):
            pub.publish([Cleared()])
        got = [sub.recv_multipart() for _ in range(5)]
        assert [int.from_bytes(f[1], "big") for f in got] == list(range(5))
        assert {f[0] for f in got} == {b"kv"}
        batch, events = decode_batch(got[0][2])
        assert batch.data_parallel_rank == 3 and type(events[0]).__name__ == "AllBlocksCleared"
        # a subscriber that saw only up to 1 asks for the rest
        replay = ctx.socket(zmq.DEALER)
        replay.connect(pub.replay_endpoint)
        replay.send_multipart([b"", (2).to_bytes(8, "big")])
        frames = []
        while True:
            assert replay.poll(2000), "replay answered"
            _, topic, seq, payload = replay.recv_multipart()
            if seq == END_SEQ:
                break
            frames.append((int.from_bytes(seq, "big"), payload))
        assert [s for s, _ in frames] == [2, 3, 4]
        assert [p for _, p in frames] == [f[2] for f in got[2:]]
        replay.close(0)
        sub.close(0)
    finally:
        pub.close()
        ctx.destroy(0)


def test_a_subscriber_that_stops_reading_never_blocks_publishing():
    from prometheus_client import CollectorRegistry, Counter

    from gapless.common.kv_events import BlockStored as Stored

    ctx = zmq.Context()
    registry = CollectorRegistry()
    dropped = Counter("gapless_kv_events_dropped_batches", "", registry=registry)
    pub = KvEventPublisher(ctx, "0", rank=0, max_queue=8, dropped=dropped)
    try:
        stalled = subscribe(ctx, pub.endpoint)
        stalled.setsockopt(zmq.RCVHWM, 1)
        time.sleep(0.2)
        events = [Stored([bytes(32)] * 64, None, list(range(1024)), 16, None, "GPU", None)]
        took = []
        for _ in range(3000):
            t0 = time.perf_counter()
            pub.publish(events)
            took.append(time.perf_counter() - t0)
        # why not the slowest: the sending thread holds the GIL now and then (a few ms)
        assert sorted(took)[len(took) // 2] < 1e-3 and sum(took) < 1.5, "publish waited"
        assert pub.num_dropped > 0
        assert (
            registry.get_sample_value("gapless_kv_events_dropped_batches_total") == pub.num_dropped
        )
        stalled.close(0)
    finally:
        pub.close()
        ctx.destroy(0)


@pytest.mark.parametrize("endpoint, rank, want", [
    ("5557", 0, "tcp://127.0.0.1:5557"), ("5557", 2, "tcp://127.0.0.1:5559"),
    ("tcp://*:6000", 1, "tcp://*:6001"), ("tcp://10.0.0.2:0", 1, "tcp://10.0.0.2:0"),
])  # fmt: skip
def test_replica_k_binds_the_base_port_plus_k(endpoint, rank, want):
    from gapless.core.kv_publisher import bind_address

    assert bind_address(endpoint, rank) == want
