"""The routing bench's view of a server follows its KV events: blocks named by the router's own
chain over their tokens, forgotten when removed or cleared."""

from __future__ import annotations

import msgspec

from gapless.bench.routing import ROOT_KEY, ServerView, chain
from gapless.common.kv_events import KvEventBatch, KvEventLog


def through_the_wire(log: KvEventLog) -> list[dict]:
    payload = msgspec.msgpack.encode(KvEventBatch(0.0, log.take(), 0))
    return msgspec.msgpack.decode(payload)[1]


def test_the_view_holds_what_the_events_say():
    log, view = KvEventLog(block_size=2), ServerView("http://x", "tcp://x:1")
    tokens = [5, 6, 7, 8, 9, 10]
    log.cleared()
    log.stored([b"a", b"b"], None, tokens[:4], "scope")
    log.stored([b"c"], b"b", tokens[4:], "scope")
    for event in through_the_wire(log):
        view.apply(event)
    names = chain(ROOT_KEY, tokens + [11], 2)
    assert view.matched(names) == 3
    log.removed([b"b"])
    for event in through_the_wire(log):
        view.apply(event)
    assert view.matched(names) == 1, "a lookup stops at the first missing block"
    log.cleared()
    for event in through_the_wire(log):
        view.apply(event)
    assert view.matched(names) == 0 and not view.names
