"""A malformed frame on an internal socket is dropped, logged and counted; the receiver goes on.
A ring name from a frame never leaves /dev/shm nor our run's prefix."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import msgspec
import pytest
import zmq
from prometheus_client import REGISTRY

from gapless.core.common.channel import Receiver, Sender
from gapless.core.common.messages import Abort, CoreInput
from gapless.shm.frames import ANNOUNCE, MARK, RECORD
from gapless.shm.names import SHM_DIR, check_ring_name
from gapless.shm.ring import HEADER_BYTES, MAGIC

_REF = struct.Struct("<BBQI")


def _ref(kind: int, name: bytes, pos: int = 0, length: int = 0) -> bytes:
    return _REF.pack(MARK, kind, pos, length) + name


def _fake_ring(path: Path, capacity: int = 4096) -> bytes:
    """A file laid out like a ring's header, as a frame's target elsewhere on disk."""
    words = [0] * (HEADER_BYTES // 8)
    words[0], words[1] = MAGIC, capacity
    data = struct.pack(f"{len(words)}Q", *words) + bytes(capacity)
    path.write_bytes(data)
    return data


def _bad(socket: str) -> float:
    return REGISTRY.get_sample_value("gapless_bad_frames_total", {"socket": socket}) or 0.0


def test_malformed_frames_are_dropped_and_counted(tmp_path: Path, caplog) -> None:
    run = tmp_path / "gapless-1-test"
    run.mkdir()
    address = f"ipc://{run}/core_in"
    outside = tmp_path / "outside"
    original = _fake_ring(outside)
    escape = os.path.relpath(outside, SHM_DIR).encode()  # ../../tmp/.../outside
    ctx = zmq.Context()
    inbox: Receiver[CoreInput] = Receiver(ctx, address, CoreInput)
    raw = ctx.socket(zmq.PUSH)
    raw.connect(address)
    sender: Sender[CoreInput] = Sender(ctx, address)
    before = _bad("core_in")
    try:
        frames = [
            b"\xff\x00garbage",  # not msgpack
            msgspec.msgpack.encode({"not": "a message"}),  # msgpack, not of the union
            msgspec.msgpack.encode(["Abort", [1, 2]]),  # the tag, wrong field types
            b"\xc1",  # a reference frame cut short
            _ref(ANNOUNCE, escape),  # a path out of /dev/shm
            _ref(ANNOUNCE, b"gapless-other-run-x-1-0"),  # another run's ring
            _ref(ANNOUNCE, b"\xff\xfe"),  # not a name
            _ref(RECORD, b"gapless-1-test-core_in-1-0", 0, 8),  # a ring never announced
            _ref(7, b"gapless-1-test-core_in-1-0"),  # no such kind
        ]
        for frame in frames:
            raw.send(frame)
        sender.send(Abort(["still-here"]))
        got = inbox.recv(timeout_ms=5000)
        assert got == Abort(["still-here"])
        assert inbox.drain() == []
    finally:
        for s in (raw, sender.socket):
            s.close(linger=0)
        inbox.close()
        ctx.term()
    assert _bad("core_in") - before == len(frames)
    assert outside.read_bytes() == original, "a frame's ring name wrote a file outside /dev/shm"
    assert "dropped a malformed frame" in caplog.text


@pytest.mark.parametrize(
    "name",
    ["../x", "gapless-../../etc/passwd", "gapless-a/b", "other-1-x", "gapless-", "", ".."],
)
def test_ring_names_are_checked(name: str) -> None:
    with pytest.raises(ValueError):
        check_ring_name(name)


def test_ring_names_of_another_run_are_refused() -> None:
    assert check_ring_name("gapless-12-ab-core_in-3-0", "12-ab") == "gapless-12-ab-core_in-3-0"
    with pytest.raises(ValueError):
        check_ring_name("gapless-13-ab-core_in-3-0", "12-ab")
