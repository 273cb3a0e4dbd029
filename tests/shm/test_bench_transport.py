"""Round trip of one message to another process and back: ZMQ frames vs the shm ring.

The echo process decodes each `Blob` (its payload into bytes, then a numpy view of them) and
answers with a tiny `Ack`. `zmq` sends the encoded message as one ipc frame; `shm` writes it
into the ring and sends a reference frame. Numbers: `make bench` or
`pytest tests/shm/test_bench_transport.py --benchmark-enable`; they set SHM_THRESHOLD.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import msgspec
import numpy as np
import pytest
import zmq

from gapless import shm
from gapless.common.channel import Receiver, Sender

SIZES = {"1KB": 2**10, "4KB": 2**12, "16KB": 2**14, "64KB": 2**16, "256KB": 2**18, "1MB": 2**20}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Blob(msgspec.Struct, tag=True, array_like=True, gc=False):
    seq: int
    data: bytes


class Ack(msgspec.Struct, tag=True, array_like=True, gc=False):
    seq: int
    size: int
    checksum: int  # sum of every STRIDE-th byte and the last one


STRIDE = 4099  # a prime: the sampled bytes fall at every offset within a page


def ack_of(seq: int, data: bytes) -> Ack:
    """The echo's answer to Blob(seq, data): cheap next to the copy, even for 1 MB."""
    arr = np.frombuffer(data, dtype=np.uint8)
    checksum = int(arr[::STRIDE].sum(dtype=np.int64)) + int(arr[-1]) if arr.size else 0
    return Ack(seq=seq, size=arr.size, checksum=checksum)


def echo_main(data_addr: str, ack_addr: str) -> None:
    """The other process: decode every Blob, answer with an Ack; a Blob of seq -1 ends it."""
    ctx = zmq.Context()
    inbox: Receiver[Blob] = Receiver(ctx, data_addr, Blob)
    acks: Sender[Ack] = Sender(ctx, ack_addr)
    acks.send(ack_of(0, b""))  # bound and listening
    parent = os.getppid()
    while True:
        msg = inbox.recv(timeout_ms=1000)
        if msg is None:
            if os.getppid() != parent:  # the test process is gone
                break
            continue
        if msg.seq < 0:
            break
        acks.send(ack_of(msg.seq, msg.data))
    acks.socket.close(linger=1000)
    inbox.close()
    ctx.term()


@pytest.fixture(scope="module")
def link():
    run_dir = tempfile.mkdtemp(prefix=f"gapless-{os.getpid()}-")
    data_addr, ack_addr = f"ipc://{run_dir}/bench_in", f"ipc://{run_dir}/bench_ack"
    ctx = zmq.Context()
    acks: Receiver[Ack] = Receiver(ctx, ack_addr, Ack)
    code = f"from tests.shm.test_bench_transport import echo_main; echo_main({data_addr!r}, {ack_addr!r})"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    senders: dict[str, Sender[Blob]] = {}
    try:
        assert acks.recv(timeout_ms=20_000) == ack_of(0, b""), "echo process did not start"
        senders["zmq"] = Sender(ctx, data_addr)
        senders["shm"] = Sender(ctx, data_addr, shm=True, shm_capacity=8 * 2**20, shm_threshold=0)
        for i in (1, 2):  # the first send announces the ring; by the second it is attached
            senders["shm"].send(Blob(seq=i, data=b"x"))
            assert acks.recv(timeout_ms=5_000) == ack_of(i, b"x")
        prefix = f"gapless-{shm.run_id_of(run_dir)}-"
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(prefix)], "not unlinked"
        yield senders, acks
        senders["zmq"].send(Blob(seq=-1, data=b""))
        assert proc.wait(10) == 0
    finally:
        for s in senders.values():
            s.close()
        acks.close()
        if proc.poll() is None:
            proc.kill()
        ctx.destroy(linger=0)
        shm.cleanup_run(shm.run_id_of(run_dir))
        for name in os.listdir(run_dir):
            os.unlink(os.path.join(run_dir, name))
        os.rmdir(run_dir)


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("transport", ["zmq", "shm"])
def test_round_trip(benchmark, link, transport: str, size: str) -> None:
    senders, acks = link
    sender = senders[transport]
    msg = Blob(seq=7, data=np.random.default_rng(0).bytes(SIZES[size] - 1) + b"\x05")
    benchmark.group = f"round trip {size}"

    def round_trip() -> Ack | None:
        sender.send(msg)
        return acks.recv(timeout_ms=5_000)

    ack = benchmark(round_trip)
    assert ack == ack_of(7, msg.data) and ack.size == SIZES[size]
