"""A stand-in for the engine that is never the limit: `bench sse-ceiling` puts it where the core
would be, so the frontends' own ceiling shows.

`python -m gapless.bench.flood STEP_MS RESULT_JSON` (config in GAPLESS_CONFIG, as every role
gets it): binds the core's socket, takes AddRequest and Abort from the frontends, and every
STEP_MS sends each frontend one TextDeltas with one token for each of its live requests, as a
decode step of the whole batch would. Token k of a request has the text " k", so a client can
tell a lost or reordered token; the last one (k = max_tokens - 1) finishes with "length". On
Shutdown it writes what it sent (tokens per request, aborted ids, its CPU in cores from its
first step to its last, steps, late steps) to RESULT_JSON and exits.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass

import zmq

from gapless.common.channel import Receiver, Sender
from gapless.common.config import EngineConfig
from gapless.common.messages import (
    Abort,
    AddRequest,
    CoreInput,
    FrontendInput,
    Shutdown,
    TextDelta,
    TextDeltas,
)
from gapless.common.process import CORE_IN, ControlReporter, child_setup, frontend_socket

IDLE_POLL_MS = 100


@dataclass
class _Live:
    frontend_id: int
    num_prompt_tokens: int
    max_tokens: int
    num_sent: int = 0


class Flood:
    def __init__(self, config: EngineConfig, ctx: zmq.Context) -> None:
        self.inbox: Receiver[CoreInput] = Receiver(ctx, config.engine_ipc(CORE_IN), CoreInput)
        self.outs: list[Sender[FrontendInput]] = [
            Sender(ctx, config.ipc(frontend_socket(i))) for i in range(config.api_servers)
        ]
        self.live: dict[str, _Live] = {}
        self.sent: dict[str, int] = {}  # request id -> tokens sent
        self.aborted: list[str] = []
        self.num_steps = 0
        self.num_late = 0  # steps that began more than a step late
        # (perf_counter, process_time) at the first step's start and at the last step's end
        self.first: tuple[float, float] | None = None
        self.last: tuple[float, float] | None = None
        self.stopped = False

    def take(self, msgs: list[CoreInput]) -> None:
        for msg in msgs:
            match msg:
                case AddRequest(request_id=rid, frontend_id=fid, params=params):
                    self.live[rid] = _Live(fid, len(msg.prompt_token_ids), params.max_tokens)
                    self.sent[rid] = 0
                case Abort(request_ids=ids):
                    for rid in ids:
                        if self.live.pop(rid, None) is not None:
                            self.aborted.append(rid)
                case Shutdown():
                    self.stopped = True

    def step(self) -> None:
        """One token for every live request, one TextDeltas per frontend."""
        per_front: list[list[TextDelta]] = [[] for _ in self.outs]
        done = []
        for rid, req in self.live.items():
            k = req.num_sent
            req.num_sent = k + 1
            last = req.num_sent >= req.max_tokens
            per_front[req.frontend_id].append(
                TextDelta(
                    rid,
                    f" {k}",
                    [k],
                    req.num_prompt_tokens,
                    req.num_sent,
                    "length" if last else None,
                )
            )
            if last:
                done.append(rid)
        for rid in done:
            self.sent[rid] = self.live.pop(rid).num_sent
        for out, deltas in zip(self.outs, per_front, strict=True):
            if deltas:
                out.send(TextDeltas(deltas))
        self.num_steps += 1

    def run(self, step_s: float) -> None:
        next_at = time.perf_counter()
        while not self.stopped:
            if not self.live:
                msg = self.inbox.recv(timeout_ms=IDLE_POLL_MS)
                self.take([msg] if msg is not None else [])
                next_at = time.perf_counter()
                continue
            self.take(self.inbox.drain())
            now = time.perf_counter()
            if now < next_at:
                time.sleep(next_at - now)
            elif now - next_at > step_s:  # more than a step late: count it, do not catch up
                self.num_late += 1
                next_at = now
            if self.first is None:
                self.first = (time.perf_counter(), time.process_time())
            self.step()
            self.last = (time.perf_counter(), time.process_time())
            next_at += step_s
        for rid, req in self.live.items():  # still running at shutdown
            self.sent[rid] = req.num_sent

    def close(self) -> None:
        self.inbox.close()
        for out in self.outs:
            out.close()


def _cores(first: tuple[float, float] | None, last: tuple[float, float] | None) -> float:
    if first is None or last is None or last[0] <= first[0]:
        return 0.0
    return (last[1] - first[1]) / (last[0] - first[0])


def main(argv: list[str]) -> None:
    step_s, result_path = float(argv[0]) / 1e3, argv[1]
    config = child_setup("flood")
    ctx = zmq.Context()
    flood = Flood(config, ctx)
    reporter = ControlReporter(ctx, config, "flood")
    reporter.ready()
    reporter.close()
    try:
        flood.run(step_s)
    finally:
        flood.close()
        ctx.term()
    result = {
        "sent": flood.sent,
        "aborted": flood.aborted,
        # cores busy from its first step to its last
        "cpu": _cores(flood.first, flood.last),
        "num_steps": flood.num_steps,
        "num_late_steps": flood.num_late,
    }
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1:])
