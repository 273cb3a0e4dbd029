from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import zmq
import zmq.asyncio

from gapless import shm
from gapless.common.channel import AsyncReceiver, Receiver, Sender
from gapless.common.messages import DetokInput, DetokNew, SamplingParams, Shutdown, TokenBatch
from gapless.shm.names import SHM_DIR
from gapless.shm.ring import RingFull, ShmRing, record_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def names_of(run_id: str) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"gapless-{run_id}-")]


@pytest.fixture
def run_id(request):
    """A run id as the supervisor makes them (`<pid>-<suffix>`); its segments go at teardown."""
    rid = f"{os.getpid()}-t{abs(hash(request.node.name)) % 10**8}"
    yield rid
    shm.cleanup_run(rid)


@pytest.fixture
def pair(run_id):
    producer = ShmRing.create(shm.ring_name(run_id, "pair"), 1024)
    consumer = ShmRing.attach(producer.name)
    yield producer, consumer
    consumer.close()
    producer.close()


def payload(seq: int, size: int) -> bytes:
    return bytes((seq + i) % 251 for i in range(size))


# ---------------------------------------------------------------- one process


def test_wrap_around_random_sizes(pair) -> None:
    producer, consumer = pair
    rng = random.Random(1234)
    sent, got, seq = [], [], 0
    for _ in range(3000):
        if rng.random() < 0.55:
            data = payload(seq, rng.choice([0, 1, 7, 8, 9, rng.randrange(400)]))
            pos = producer.try_write(data)
            if pos is not None:
                sent.append((pos, data))
                seq += 1
        elif (rec := consumer.read()) is not None:
            pos, view = rec
            got.append((pos, bytes(view)))
            view.release()
            consumer.release()
    while (rec := consumer.read()) is not None:
        got.append((rec[0], bytes(rec[1])))
        rec[1].release()
        consumer.release()
    assert got == sent
    assert sent[-1][0] > 20 * producer.capacity, "the ring wrapped many times"


def test_full_ring(pair) -> None:
    producer, consumer = pair
    size = record_bytes(120)  # 128 bytes: 8 records fill the 1024-byte ring exactly
    for i in range(producer.capacity // size):
        assert producer.try_write(payload(i, 120)) == i * size
    assert producer.free_bytes() == 0
    assert producer.try_write(b"") is None
    with pytest.raises(RingFull, match=r"no room for 5 bytes after 0.05s .*is not reading"):
        producer.write(b"12345", timeout_s=0.05)
    with pytest.raises(ValueError, match="exceeds"):
        producer.write(bytes(producer.capacity))
    assert producer.try_write(bytes(producer.capacity)) is None

    pos, view = consumer.read()
    assert pos == 0 and bytes(view) == payload(0, 120)
    view.release()
    consumer.release()
    assert producer.write(b"12345", timeout_s=0.05) == 8 * size  # fits where record 0 was


def test_wrap_keeps_records_contiguous(pair) -> None:
    producer, consumer = pair
    assert producer.try_write(bytes(900)) == 0
    _, view = consumer.read()
    view.release()
    consumer.release()
    # 912 used, 112 left before the end: a 200-byte record starts again at offset 0
    pos = producer.try_write(payload(3, 200))
    assert pos == producer.capacity
    rec = consumer.read()
    assert rec[0] == producer.capacity and bytes(rec[1]) == payload(3, 200)
    rec[1].release()


def test_attach_unlinks_on_next_write(run_id) -> None:
    producer = ShmRing.create(shm.ring_name(run_id, "x"), 4096)
    assert names_of(run_id) == [producer.name]
    assert not producer.attached
    consumer = ShmRing.attach(producer.name)
    producer.try_write(b"abc")
    assert names_of(run_id) == []
    assert producer.attached
    rec = consumer.read()
    assert bytes(rec[1]) == b"abc"  # the mapping outlives the name
    rec[1].release()
    consumer.close()
    producer.close()


# ---------------------------------------------------------------- two processes

PRODUCER = """
import random, sys, time
from gapless.shm.ring import ShmRing
name, count = sys.argv[1], int(sys.argv[2])
ring = ShmRing.create(name, 16384)
print("ready", flush=True)
rng = random.Random(7)
for seq in range(count):
    size = rng.randrange(4, 2000)
    ring.write(bytes((seq + i) % 251 for i in range(size)), timeout_s=20)
ring.close()
"""


def test_two_processes_10k_messages(run_id) -> None:
    name = shm.ring_name(run_id, "10k")
    proc = subprocess.Popen(
        [sys.executable, "-c", PRODUCER, name, "10000"], cwd=ROOT, stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout.readline() == b"ready\n"
        consumer = ShmRing.attach(name)
        rng = random.Random(7)
        deadline = time.monotonic() + 60
        for seq in range(10_000):
            while (rec := consumer.read()) is None:
                assert time.monotonic() < deadline, f"stuck at message {seq}"
                time.sleep(0)
            expected = payload(seq, rng.randrange(4, 2000))
            assert bytes(rec[1]) == expected, f"message {seq} differs"
            rec[1].release()
            consumer.release()
        assert consumer.read() is None
        assert proc.wait(10) == 0
        assert names_of(run_id) == []
        consumer.close()
    finally:
        proc.kill()
        proc.wait()


KILLED = """
import sys, time
from gapless.shm.ring import ShmRing
name, mode = sys.argv[1], sys.argv[2]
ring = ShmRing.create(name, 65536)
print("ready", flush=True)
if mode == "attached":
    while not ring.attached:
        time.sleep(0.001)
    print("unlinked", flush=True)
while True:
    if mode == "exit":
        sys.exit(0)
    ring.try_write(b"x" * 1000)
"""


@pytest.mark.parametrize("mode", ["created", "attached"])
@pytest.mark.parametrize("delay", [0.0, 0.01, 0.05])
def test_sigkill_leaves_nothing(run_id, mode: str, delay: float) -> None:
    name = shm.ring_name(run_id, "killed")
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED, name, mode], cwd=ROOT, stdout=subprocess.PIPE
    )
    consumer = None
    try:
        assert proc.stdout.readline() == b"ready\n"
        if mode == "attached":
            consumer = ShmRing.attach(name)
            assert proc.stdout.readline() == b"unlinked\n"
            assert names_of(run_id) == [], "unlinked once the consumer attached, before cleanup"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
        shm.cleanup_run(run_id)
        assert names_of(run_id) == []
    finally:
        proc.kill()
        proc.wait()
        if consumer is not None:
            consumer.close()


def test_owner_exit_without_close_unlinks(run_id) -> None:
    name = shm.ring_name(run_id, "exit")
    out = subprocess.run([sys.executable, "-c", KILLED, name, "exit"], cwd=ROOT, timeout=30)
    assert out.returncode == 0
    assert names_of(run_id) == []


CHANNEL_KILLED = """
import sys, zmq
from gapless.common.channel import Sender
from gapless.common.messages import TokenBatch
s = Sender(zmq.Context(), sys.argv[1], shm=True)
s.send(TokenBatch(["a"], [1], [5], [""], [3]))
print("sent", flush=True)
import time; time.sleep(60)
"""


def test_channel_sender_killed_before_attach(tmp_path) -> None:
    run_dir = tmp_path / f"gapless-{os.getpid()}-chan"
    run_dir.mkdir()
    run_id = shm.run_id_of(str(run_dir))
    address = f"ipc://{run_dir}/detok_in"
    proc = subprocess.Popen(
        [sys.executable, "-c", CHANNEL_KILLED, address], cwd=ROOT, stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout.readline() == b"sent\n"
        assert len(names_of(run_id)) == 1
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert shm.cleanup_run(run_id) and names_of(run_id) == []
    finally:
        proc.kill()
        proc.wait()


def test_sweep_stale_removes_dead_runs_only(run_id) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = ShmRing.create(shm.ring_name(f"{dead.pid}-old", "c"), 64)
    live = ShmRing.create(shm.ring_name(run_id, "c"), 64)
    removed = shm.sweep_stale()
    assert stale.name in removed and live.name not in removed
    assert names_of(run_id) == [live.name]
    stale.close()
    live.close()


def test_run_id_of() -> None:
    assert shm.run_id_of("/tmp/gapless-123-ab_c8x/") == "123-ab_c8x"
    assert shm.ring_name("123-ab", "runner_in").startswith("gapless-123-ab-runner_in-")


# ---------------------------------------------------------------- channels


def batch(i: int, num_tokens: int) -> TokenBatch:
    return TokenBatch(
        request_ids=[f"r{i}"],
        counts=[num_tokens],
        token_ids=[(i * 7 + k) % 49152 for k in range(num_tokens)],
        finish_reasons=[""],
        num_prompt_tokens=[i],
    )


def test_channel_round_trip_in_order(tmp_path) -> None:
    run_dir = tmp_path / f"gapless-{os.getpid()}-rt"
    run_dir.mkdir()
    run_id, address = shm.run_id_of(str(run_dir)), f"ipc://{run_dir}/detok_in"
    ctx = zmq.Context()
    inbox: Receiver[DetokInput] = Receiver(ctx, address, DetokInput)
    # a small ring, so some large messages find it full and go inline
    out: Sender[DetokInput] = Sender(ctx, address, shm=True, shm_capacity=2**20)
    other: Sender[DetokInput] = Sender(ctx, address)  # a plain sender on the same socket
    try:
        rng = random.Random(5)
        sizes = [10, 40_000, 10, 200_000, 5] + [
            rng.choice([3, 500, 30_000, 100_000]) for _ in range(60)
        ]
        sent: list = [DetokNew("n", 0, SamplingParams(max_tokens=4), [1, 2])]
        out.send(sent[0])
        assert inbox.recv(timeout_ms=5000) == sent[0]  # the announcement was skipped
        assert len(names_of(run_id)) == 1
        for i, n in enumerate(sizes):
            sent.append(batch(i, n))
            out.send(sent[-1])
            assert names_of(run_id) == [], "unlinked on the first send after the attach"
            if i == 30:
                got_mid = inbox.drain()
        other.send(Shutdown())
        got = [sent[0], *got_mid]
        while len(got) < len(sent) + 1:
            msg = inbox.recv(timeout_ms=5000)
            assert msg is not None, f"{len(got)} of {len(sent) + 1} messages"
            got.append(msg)
        # in order per sender; the other sender's message lands anywhere
        assert [m for m in got if not isinstance(m, Shutdown)] == sent
        assert got.count(Shutdown()) == 1
        assert out._ring.ring._head > 2**20, "large messages went through the ring, wrapping"
        assert inbox.recv(timeout_ms=10) is None
    finally:
        out.close()
        other.close()
        inbox.close()
        ctx.destroy(linger=0)
    assert names_of(run_id) == []


def test_async_receiver_reads_ring(tmp_path) -> None:
    run_dir = tmp_path / f"gapless-{os.getpid()}-as"
    run_dir.mkdir()
    address = f"ipc://{run_dir}/frontend_0"
    actx, ctx = zmq.asyncio.Context(), zmq.Context()
    inbox: AsyncReceiver[DetokInput] = AsyncReceiver(actx, address, DetokInput)
    out: Sender[DetokInput] = Sender(ctx, address, shm=True, shm_threshold=0)
    sent = [batch(i, n) for i, n in enumerate([1, 20_000, 2, 70_000])]

    async def receive() -> list:
        return [await asyncio.wait_for(inbox.recv(), 5) for _ in sent]

    try:
        for msg in sent:
            out.send(msg)
        assert asyncio.run(receive()) == sent
    finally:
        out.close()
        inbox.close()
        ctx.destroy(linger=0)
        actx.destroy(linger=0)


def test_shm_needs_ipc_address() -> None:
    ctx = zmq.Context()
    with pytest.raises(ValueError, match="ipc://"):
        Sender(ctx, "tcp://127.0.0.1:5999", shm=True)
    ctx.destroy(linger=0)
