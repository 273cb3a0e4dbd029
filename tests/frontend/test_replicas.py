"""Routing between engine replicas (--data-parallel-size): fewest tokens before a request,
a held prefix when that wins, each tenant's prefixes its own, and the frontend's
bookkeeping (aborts, queue counts, heartbeats) per replica."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry

from gapless.common.messages import Abort, AddRequest, Heartbeat, QueueState, SamplingParams
from gapless.core.kv_blocks import chain_hashes, hash_root
from gapless.frontend.engine import replicas
from gapless.frontend.engine.client import EngineClient
from gapless.frontend.engine.inbox import Inbox
from gapless.frontend.engine.replicas import ReplicaRouter, routed_counter
from tests.timing import late_limit_s

BS = 16


def _hashes(tokens: list[int], scope: str = "") -> list[bytes]:
    return chain_hashes(hash_root("model", scope), tokens, BS)


def _state(replica: int, tokens: list[int]) -> QueueState:
    return QueueState([0] * len(tokens), tokens, [{} for _ in tokens], 0.0, replica=replica)


def test_a_request_goes_where_fewest_tokens_wait() -> None:
    r = ReplicaRouter(3, frontend_id=0, block_size=BS)
    r.add(0, [], 500)
    r.add(1, [], 100)
    assert r.choose([]) == 2  # nothing waits there
    r.add(2, [], 300)
    assert r.choose([]) == 1
    r.leave(0, 500)  # replica 0's request started
    assert r.choose([]) == 0


def test_ties_go_to_fewest_in_flight_then_in_turn() -> None:
    r = ReplicaRouter(2, frontend_id=0, block_size=BS)
    picks = [r.choose([]) for _ in range(4)]
    assert picks == [0, 1, 0, 1]  # an idle pair takes turns
    for _ in range(3):  # three started on replica 0 and run on
        r.add(0, [], 8)
        r.leave(0, 8)
    assert [r.choose([]) for _ in range(3)] == [1, 1, 1]
    for _ in range(3):
        r.ended(0)
    r.add(1, [], 8)
    r.leave(1, 8)
    assert r.choose([]) == 0


def test_the_other_frontends_waiting_tokens_count_but_not_this_ones() -> None:
    r = ReplicaRouter(2, frontend_id=1, block_size=BS)
    # replica 0: the other frontend has 900 tokens waiting; this one's 50 are counted exactly
    r.update(_state(0, [900, 50]))
    r.add(1, [], 400)
    assert r.choose([]) == 1
    r.update(_state(0, [0, 50]))
    assert r.choose([]) == 0
    r.update(_state(7, [10**9, 0]))  # a replica that is not there changes nothing
    assert r.choose([]) == 0


def test_a_held_prefix_wins_until_the_load_outweighs_it() -> None:
    r = ReplicaRouter(2, frontend_id=0, block_size=BS)
    prompt = list(range(1000, 1000 + 40 * BS))  # 40 full blocks: 640 tokens
    hashes = _hashes(prompt)
    first = r.choose(hashes)
    r.add(first, hashes, len(prompt))
    r.leave(first, len(prompt))  # it started
    other = 1 - first
    r.add(first, [], 300)  # 300 tokens wait on the replica holding the prefix
    assert r.choose(hashes) == first  # 300 - 640 < 0 on the other
    assert r.choose(_hashes(prompt[:BS] + [7] * 39 * BS)) == other  # only one block shared
    r.add(first, [], 400)  # now 700 wait there, more than the 640 it saves
    assert r.choose(hashes) == other


def test_one_tenants_prefix_never_draws_anothers_request() -> None:
    r = ReplicaRouter(2, frontend_id=0, block_size=BS)
    prompt = list(range(30 * BS))
    a = _hashes(prompt, scope="tenant-a")
    r.add(0, a, len(prompt))
    r.leave(0, len(prompt))
    r.add(0, [], 10)
    # tenant b's same prompt is named in b's scope: it goes by load alone
    assert r.choose(_hashes(prompt, scope="tenant-b")) == 1
    assert r.choose(a) == 0


def test_the_held_blocks_are_bounded(monkeypatch) -> None:
    monkeypatch.setattr(replicas, "MAX_BLOCKS", 8)
    r = ReplicaRouter(2, frontend_id=0, block_size=BS)
    old = _hashes(list(range(8 * BS)))
    r.add(0, old, 0)
    r.add(0, _hashes(list(range(5000, 5000 + 8 * BS))), 0)  # pushes the old prompt out
    assert len(r._held[0]) == 8
    r.add(0, [], 1)
    assert r.choose(old) == 1  # forgotten: load decides


def test_the_routed_counter_says_why() -> None:
    registry = CollectorRegistry()
    r = ReplicaRouter(2, 0, BS, routed_counter(registry))
    hashes = _hashes(list(range(4 * BS)))
    r.add(r.choose(hashes), hashes, 4 * BS)
    again = r.choose(hashes)
    value = registry.get_sample_value
    assert value("gapless_routed_requests_total", {"replica": "0", "reason": "load"}) == 1
    assert value("gapless_routed_requests_total", {"replica": str(again), "reason": "prefix"}) == 1


# ------------------------------------------------------------------ the engine client


def _request(rid: str, prompt: list[int]) -> AddRequest:
    return AddRequest(
        rid, 0, prompt, SamplingParams(max_tokens=4), time.time(), block_hashes=_hashes(prompt)
    )


class _Loop:
    def call_soon_threadsafe(self, *_):  # an inbox's wake-ups go nowhere here
        pass

    def call_soon(self, *_):
        pass


def test_every_choice_goes_to_one_replica_and_aborts_follow_them() -> None:
    sent: list[list] = [[], []]
    client = EngineClient(0, [sent[0].append, sent[1].append], block_size=BS)
    prompt = list(range(3 * BS))
    for name, n in (("a", 1), ("b", 2)):
        ticket = client.queue.take("t", n)
        ticket.set_prompt(len(prompt))
        ids = [f"{name}{i}" for i in range(n)]
        client.add([_request(i, prompt) for i in ids], Inbox(_Loop(), 0.0, name), ticket)
    # "b" shares a's prompt: its 48 tokens held there weigh as much as a's waiting, and both
    # its choices follow a's to the replica holding it
    assert [m.request_id for m in sent[0]] == ["a0", "b0", "b1"] and not sent[1]
    client.remove(["b0", "b1"], running=["b1"])
    assert sent[0][-1] == Abort(["b1"])
    ticket = client.queue.take("t", 1)
    ticket.set_prompt(4)
    client.add([_request("c0", [1, 2, 3, 4])], Inbox(_Loop(), 0.0, "c"), ticket)
    assert [m.request_id for m in sent[1]] == ["c0"]  # a's 48 tokens wait on replica 0
    client.remove(["c0"], running=["c0"])
    assert sent[1][-1] == Abort(["c0"])


def test_queue_counts_add_up_over_replicas_and_health_hears_each_core() -> None:
    client = EngineClient(0, [lambda m: None, lambda m: None])
    for replica, n in ((0, 3), (1, 4)):
        tenants = [{}, {"t": n}]
        client.dispatch(QueueState([0, n], [0, 10 * n], tenants, 1.0, replica=replica))
    assert client.queue.num_queued == 7 and client.queue.num_queued_tokens == 70
    assert client.queue.num_tenant_queued("t") == 7
    assert client.queue.drain_per_s() == 2.0
    client.dispatch(QueueState([0, 0], [0, 0], [{}, {}], 1.0, replica=1))
    assert client.queue.num_queued == 3
    client._heartbeats = [time.monotonic() - 10, time.monotonic() - 10]
    client.dispatch(Heartbeat(replica=0))
    assert client.core_silent_s() >= 10  # replica 1's core has been silent
    client.dispatch(Heartbeat(replica=1))
    assert client.core_silent_s() < late_limit_s(0)  # both beat just now
    client.dispatch(Heartbeat(replica=5))  # no such replica: dropped
    assert client.core_silent_s() < late_limit_s(0)


def test_a_requests_waiting_tokens_leave_its_replica_once_whatever_ends_it() -> None:
    from gapless.common.messages import TextDelta, TextDeltas

    client = EngineClient(0, [lambda m: None, lambda m: None], block_size=BS)
    ticket = client.queue.take("t", 2)  # two prompts of different lengths, one choice each
    ticket.set_prompt(30)
    inbox = Inbox(_Loop(), 0.0, "x")
    client.add([_request("p0", list(range(10)))], inbox, ticket)
    client.add([_request("p1", list(range(20)))], inbox, ticket)
    assert sorted(client.router._mine) == [10, 20]
    client.dispatch(TextDeltas([TextDelta("p0", "a", [5], 10, 1)]))  # p0 started
    client.dispatch(TextDeltas([TextDelta("p0", "b", [6], 10, 2)]))
    assert sorted(client.router._mine) == [0, 20]
    client.remove(["p0", "p1"], running=["p0", "p1"])  # p1 ended before it started
    assert client.router._mine == [0, 0] and not client._routed
    assert client.router._inflight == [0, 0]
