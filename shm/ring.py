"""A single-producer / single-consumer byte ring in a POSIX shared-memory file (/dev/shm).

Layout (all words u64, native byte order, 8-byte aligned):

    [0, 256)          header: magic, capacity, producer pid | head | tail, consumer pid
    [256, 256 + cap)  data: records, each a length word then the payload, padded to 8 bytes

`head` and `tail` count bytes ever written / freed (they never wrap; 2**64 bytes is centuries
away). The producer writes a record's payload, then its length word, then publishes `head`;
the consumer reads `head`, then the record, and frees it by advancing `tail`. A record that
would run past the end of the data region is preceded by a WRAP length word and starts again
at offset 0, so every payload is contiguous (decoders read it in place).

Memory ordering: each word is one aligned 8-byte memcpy (memoryview 'Q' items), a single
store or load on x86-64, and x86-64 (TSO) neither reorders stores with stores nor loads with
loads, so a consumer that sees the new `head` sees the record. A weakly ordered CPU (ARM)
would need fences the standalone `read()` path does not have; the channel path is safe there
as well, because the consumer learns of each record from a ZMQ frame sent after the write
(the socket write and read are system calls, which order memory).

Ownership: the producer creates the file and is the only one to unlink it; it does so on its
first write after the consumer attached (the consumer writes its pid into the header), or at
close. Both mappings stay valid after the unlink. Names a crash left behind are removed by
`shm.names.cleanup_run` / `sweep_stale`.
"""

from __future__ import annotations

import mmap
import os
import time
import weakref

from gapless.shm.names import SHM_DIR, check_ring_name

HEADER_BYTES = 256
MAGIC = int.from_bytes(b"gapring1", "little")
WRAP = 2**64 - 1  # length word meaning "the next record starts at data offset 0"

# header word indices; producer and consumer words sit on separate 64-byte cache lines
_MAGIC, _CAPACITY, _PRODUCER = 0, 1, 2
_HEAD = 8  # producer-written
_TAIL, _CONSUMER = 16, 17  # consumer-written


class RingFull(Exception):
    pass


def record_bytes(n: int) -> int:
    """Ring bytes one payload of n bytes takes: length word plus payload padded to 8."""
    return 8 + ((n + 7) & ~7)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class ShmRing:
    """One end of a ring. Make it with `create` (producer) or `attach` (consumer)."""

    def __init__(self, name: str, mm: mmap.mmap, is_producer: bool) -> None:
        self.name = name
        self.path = os.path.join(SHM_DIR, name)
        self.is_producer = is_producer
        self._mm = mm
        self._hdr = memoryview(mm)[:HEADER_BYTES].cast("Q")
        self._buf = memoryview(mm)[HEADER_BYTES:]  # the data region, bytes
        self._words = self._buf.cast("Q")  # the data region, u64 words
        self.capacity = len(self._buf)
        self._head = self._hdr[_HEAD]  # producer: next free byte, published after each write
        self._tail = self._hdr[_TAIL]  # consumer: first unread byte
        self._next_tail = self._tail  # consumer: tail once the record being read is released
        self._unlinked = not is_producer
        # an owner that exits without close() still removes its name (not on SIGKILL)
        self._finalizer = weakref.finalize(self, _unlink, self.path) if is_producer else None

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def create(cls, name: str, capacity: int) -> ShmRing:
        """Producer: a new segment with `capacity` data bytes (a multiple of 8)."""
        assert capacity >= 64 and capacity % 8 == 0, f"bad ring capacity {capacity}"
        path = os.path.join(SHM_DIR, check_ring_name(name))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                # why: reserve the pages now, so a full /dev/shm fails here and not as SIGBUS
                os.posix_fallocate(fd, 0, HEADER_BYTES + capacity)
            except OSError:
                _unlink(path)
                raise
            mm = mmap.mmap(fd, HEADER_BYTES + capacity)
        finally:
            os.close(fd)
        ring = cls(name, mm, is_producer=True)
        ring._hdr[_CAPACITY] = capacity
        ring._hdr[_PRODUCER] = os.getpid()
        ring._hdr[_MAGIC] = MAGIC
        return ring

    @classmethod
    def attach(cls, name: str) -> ShmRing:
        """Consumer: map an existing segment and tell its producer, which may then unlink it."""
        path = os.path.join(SHM_DIR, check_ring_name(name))
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES + 64:
                raise ValueError(f"{name} is not a gapless ring ({size} bytes)")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        ring = cls(name, mm, is_producer=False)
        if ring._hdr[_MAGIC] != MAGIC or ring._hdr[_CAPACITY] != ring.capacity:
            ring.close()
            raise ValueError(f"{name} is not a gapless ring")
        ring._hdr[_CONSUMER] = os.getpid()
        return ring

    @property
    def attached(self) -> bool:
        """Producer: whether the consumer has mapped the ring (its name is then unlinked)."""
        if self._hdr[_CONSUMER] == 0:
            return False
        if not self._unlinked:
            self.unlink()
        return True

    def unlink(self) -> None:
        """Producer: remove the name; both mappings stay valid."""
        assert self.is_producer, "only the producer unlinks a ring"
        if not self._unlinked:
            _unlink(self.path)
            self._unlinked = True
        if self._finalizer is not None:
            self._finalizer.detach()

    def close(self) -> None:
        if self.is_producer:
            self.unlink()
        for view in (self._hdr, self._words, self._buf):
            view.release()
        self._mm.close()

    # ------------------------------------------------------------------ producer

    def free_bytes(self) -> int:
        return self.capacity - (self._head - self._hdr[_TAIL])

    def try_write(self, data) -> int | None:
        """Append one record; its position (an absolute byte count), or None if it does not fit
        now. `data` is any C-contiguous bytes-like object."""
        if not self._unlinked and self._hdr[_CONSUMER]:
            self.unlink()
        if not isinstance(data, bytes):
            data = memoryview(data).cast("B")
        n = len(data)
        size = record_bytes(n)
        head = self._head
        off = head % self.capacity
        skip = self.capacity - off if off + size > self.capacity else 0
        if head + skip + size - self._hdr[_TAIL] > self.capacity:
            return None
        if skip:
            self._words[off // 8] = WRAP
            head += skip
            off = 0
        self._buf[off + 8 : off + 8 + n] = data
        self._words[off // 8] = n
        self._head = head + size
        self._hdr[_HEAD] = self._head  # published last: the record is complete
        return head

    def write(self, data, timeout_s: float = 1.0) -> int:
        """Append one record, waiting up to timeout_s for the consumer to free space."""
        n = memoryview(data).nbytes
        if record_bytes(n) > self.capacity:
            raise ValueError(f"ring {self.name}: a {n}-byte record exceeds {self.capacity} bytes")
        pos = self.try_write(data)
        if pos is not None:
            return pos
        deadline = time.monotonic() + timeout_s
        pause = 0.0
        while (pos := self.try_write(data)) is None:
            if time.monotonic() > deadline:
                raise RingFull(
                    f"ring {self.name}: no room for {n} bytes after {timeout_s}s "
                    f"({self.free_bytes()} of {self.capacity} free); consumer pid "
                    f"{self._hdr[_CONSUMER] or 'none (never attached)'} is not reading"
                )
            time.sleep(pause)
            pause = min(2 * pause + 1e-5, 1e-3)  # s: yield first, then back off to 1 ms
        return pos

    # ------------------------------------------------------------------ consumer

    def read(self) -> tuple[int, memoryview] | None:
        """The oldest unreleased record as (position, payload view), or None if none is
        published. The view is valid until `release()`; release the view first."""
        tail = self._tail
        if tail == self._hdr[_HEAD]:
            return None
        off = tail % self.capacity
        n = self._words[off // 8]
        if n == WRAP:
            tail += self.capacity - off
            off = 0
            n = self._words[0]
        self._next_tail = tail + record_bytes(n)
        return tail, self._buf[off + 8 : off + 8 + n]

    def release(self) -> None:
        """Free the record returned by the last `read()` for the producer to reuse."""
        self._tail = self._next_tail
        self._hdr[_TAIL] = self._tail
