"""Ring references carried in ZMQ frames, for the typed channels in core/channel.py.

A reference frame starts with 0xC1, a byte msgpack never uses, so it cannot be mistaken for an
encoded message and one socket can mix references, inline messages, and messages from senders
without a ring (the supervisor's Shutdown, say):

    0xC1, kind (u8), position (u64), length (u32), then the ring's name (utf-8)

ANNOUNCE names a new ring: the consumer attaches to it, which lets the producer unlink the name
and start writing records. RECORD points at the next record of that ring. Until the consumer
has attached, the producer sends everything inline, so no record ever waits in a ring the
consumer has not mapped, and closing a producer loses nothing.
"""

from __future__ import annotations

import struct

from gapless.shm.names import check_ring_name
from gapless.shm.ring import ShmRing

MARK = 0xC1
ANNOUNCE, RECORD = 0, 1
_REF = struct.Struct("<BBQI")


def is_ref(buf: memoryview) -> bool:
    return len(buf) > 0 and buf[0] == MARK


class RingWriter:
    """Producer side of one channel: puts messages of `threshold` bytes or more in the ring."""

    def __init__(self, name: str, capacity: int, threshold: int) -> None:
        self.ring = ShmRing.create(name, capacity)
        self.threshold = threshold
        self._name = name.encode()
        self._attached = False
        self.announcement: bytes | None = _REF.pack(MARK, ANNOUNCE, 0, 0) + self._name

    def frame(self, data: bytes) -> bytes:
        """What to send for one encoded message: a reference into the ring, or `data` itself
        (below the threshold, before the consumer attached, or while the ring is full)."""
        if not self._attached:
            self._attached = self.ring.attached  # unlinks the name once the consumer is in
            if not self._attached:
                return data
        if len(data) < self.threshold:
            return data
        pos = self.ring.try_write(data)
        if pos is None:
            return data
        return _REF.pack(MARK, RECORD, pos, len(data)) + self._name

    def close(self) -> None:
        self.ring.close()


class BadRef(ValueError):
    """A reference frame that names no ring of ours or no record in it; the frame is dropped."""


class RingReader:
    """Consumer side of one socket: the rings its frames name, by name. With `run_id`, only
    rings of that run are attached."""

    def __init__(self, run_id: str | None = None) -> None:
        self._rings: dict[bytes, ShmRing] = {}
        self._run_id = run_id

    def open(self, buf: memoryview) -> tuple[ShmRing, memoryview] | None:
        """The payload a reference frame points at, or None for an announcement. Release the
        view, then the ring, once the payload is decoded. BadRef for a frame that is not one
        of ours (a malformed header, a foreign or unsafe name, an unannounced ring)."""
        if len(buf) < _REF.size:
            raise BadRef(f"a reference frame of {len(buf)} bytes")
        _, kind, pos, length = _REF.unpack_from(buf)
        name = bytes(buf[_REF.size :])
        if kind == ANNOUNCE:
            if name not in self._rings:
                try:
                    ring_name = check_ring_name(name.decode(), self._run_id)
                except (UnicodeDecodeError, ValueError) as e:
                    raise BadRef(f"announcement of {name[:100]!r}: {e}") from None
                try:
                    self._rings[name] = ShmRing.attach(ring_name)
                except FileNotFoundError:
                    # why: the producer closed (or a cleanup ran) first; it never saw us
                    # attach, so it sends everything inline and nothing is lost
                    pass
                except (OSError, ValueError) as e:
                    raise BadRef(f"cannot attach {ring_name}: {e}") from None
            return None
        if kind != RECORD:
            raise BadRef(f"reference of unknown kind {kind}")
        ring = self._rings.get(name)
        if ring is None:
            raise BadRef(f"record in ring {name[:100]!r}, which was never announced")
        got = ring.read()
        # why not assert: a stray frame must not stop the consumer; the record a wrong
        # reference points past stays unread for the real reference that follows
        if got is None or got[0] != pos or len(got[1]) != length:
            raise BadRef(f"ring {name!r}: no record of {length} bytes at {pos}")
        return ring, got[1]

    def close(self) -> None:
        for ring in self._rings.values():
            ring.close()
        self._rings.clear()
