"""Publishes a core's KV events to routers as vLLM 0.33.0's ZmqEventPublisher frames them.

PUB frames: `(topic, seq, payload)`, seq an 8-byte big-endian batch number, payload a msgpack
KvEventBatch. Replay (ROUTER): a subscriber sends `(b"", seq)` and gets `(b"", topic, seq,
payload)` for every kept batch from seq on, then `(b"", b"", -1 as 8 signed bytes, b"")`.

Publishing never blocks a step: `publish` numbers the batch and puts it on a bounded queue;
a full queue drops it (counted), which leaves a gap in the numbers, as does a subscriber's
own loss. A thread encodes, sends (PUB drops at its high-water mark, never waits) and keeps
the last `buffer` batches for replay. A gap replay cannot fill means the subscriber's view of
this replica is unknown: it should forget what it knows of it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import msgspec
import zmq
from prometheus_client import Counter

from gapless.common.kv_events import Event, KvEventBatch

log = logging.getLogger("gapless.core")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
# batches a slow subscriber may owe before PUB drops for it: as many as replay keeps, since one
# further behind needs more than replay can give (vLLM's 100,000 lets a stalled subscriber cost
# ten times the ring's memory)
SEND_HWM = 10_000


def bind_address(endpoint: str, replica: int) -> str:
    """Where replica k binds: `tcp://HOST:PORT` or `PORT` (127.0.0.1), the port + k (a port
    of 0 lets the system choose)."""
    if endpoint.isdigit():
        endpoint = f"tcp://127.0.0.1:{endpoint}"
    assert endpoint.startswith("tcp://") and ":" in endpoint[6:], endpoint
    host, port = endpoint.rsplit(":", 1)
    return f"{host}:{int(port) + replica if int(port) else 0}"


class KvEventPublisher:
    """The core's side of the event stream of one replica (data-parallel rank)."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        rank: int = 0,
        max_queue: int = 1024,
        buffer: int = 10_000,
        dropped: Counter | None = None,
    ) -> None:
        self.rank = rank
        self._topic = topic.encode()
        self._queue: queue.Queue[tuple[int, KvEventBatch] | None] = queue.Queue(max_queue)
        self._seq = 0  # the next batch's number
        self.num_dropped = 0
        self._dropped = dropped
        self._kept: list[tuple[int, bytes]] = []  # ring of (seq, payload), `buffer` long
        self._buffer = buffer
        self._next = 0  # where the ring's next entry goes once full
        # created here so that a bind error reaches the caller; used by the thread only
        self._pub = ctx.socket(zmq.PUB)
        self._pub.set_hwm(SEND_HWM)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(bind_address(endpoint, rank))
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay: zmq.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            self._replay = ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer + 1))
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(bind_address(replay_endpoint, rank))
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[Event]) -> None:
        """Queue one step's events (nothing when there are none); never waits."""
        if not events:
            return
        seq, self._seq = self._seq, self._seq + 1
        try:
            self._queue.put_nowait((seq, KvEventBatch(time.time(), events, self.rank)))
        except queue.Full:
            self.num_dropped += 1
            if self._dropped is not None:
                self._dropped.inc()

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (for up to timeout_s), then close the sockets."""
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._pub.close()
            if self._replay is not None:
                self._replay.close()

    # the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        while True:
            # 1. answer replay requests (never more than the queue waits)
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            # 2. send the next batch
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, batch = item
            payload = encode(batch)
            seq_bytes = seq.to_bytes(8, "big")
            try:
                self._pub.send_multipart((self._topic, seq_bytes, payload), zmq.NOBLOCK)
            except zmq.Again:  # why: a PUB at its high-water mark drops; keep it for replay
                pass
            self._keep(seq, payload)

    def _keep(self, seq: int, payload: bytes) -> None:
        kept = self._kept
        if len(kept) < self._buffer:
            kept.append((seq, payload))
        else:
            kept[self._next] = (seq, payload)
            self._next = (self._next + 1) % self._buffer

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events replay: a request of %d frames ignored", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        kept = self._kept[self._next :] + self._kept[: self._next]  # oldest first
        try:
            for seq, payload in kept:
                if seq >= start:
                    self._replay.send_multipart(
                        (client, b"", self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK
                    )
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""), zmq.NOBLOCK)
        except zmq.Again:  # why: a client that does not read its replay is not waited for
            log.warning("KV events replay: a client stopped reading; its replay was cut short")
