"""The plan's fan-out to tensor-parallel ranks: per steady-decode step, what sending one plan
costs the core and how long until the last of N ranks has decoded it.

`python -m gapless.bench.plan_fanout --batch 256 --ranks 1 2 4`: each rank is a process that
reads plans as a runner rank does (a Subscriber of the core's Publisher; with `--push`, one
runner's PULL socket behind the shm-capable Sender) and answers each with its sequence number.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import msgspec
import zmq

from gapless.common.channel import Publisher, Receiver, Sender, Subscriber
from gapless.common.messages import RunnerInput, Shutdown, StepPlan

CONTEXT = 500  # tokens already in each slot


class Ack(msgspec.Struct, tag=True, array_like=True, gc=False):
    seq: int


def steady_plan(seq: int, batch: int) -> StepPlan:
    """A decode of one token per slot, every slot sampled, no new blocks (the common step)."""
    return StepPlan(seq=seq, new_slots=[], freed_slots=[], slots=list(range(batch)),
                    num_tokens=[1] * batch, start_pos=[CONTEXT] * batch,
                    has_tokens=[False] * batch, token_ids=[], sample=[True] * batch,
                    num_new_blocks=[0] * batch, new_blocks=[])  # fmt: skip


def rank_main(plans_addr: str, acks_addr: str, push: bool) -> None:
    ctx = zmq.Context()
    plans: Receiver = (
        Receiver(ctx, plans_addr, RunnerInput) if push else Subscriber(ctx, plans_addr, RunnerInput)
    )
    acks: Sender = Sender(ctx, acks_addr)
    while True:
        msg = plans.recv()
        if isinstance(msg, Shutdown):
            break
        acks.send(Ack(msg.seq))
    acks.socket.close(linger=1000)
    plans.close()
    ctx.term()


def measure(ranks: int, batch: int, steps: int, push: bool) -> dict[str, float]:
    """Median and p99 of the send (us) and of send to the last rank's ack (us)."""
    run_dir = tempfile.mkdtemp(prefix=f"gapless-{os.getpid()}-")
    ctx = zmq.Context()
    plans_addr, acks_addr = f"ipc://{run_dir}/plans", f"ipc://{run_dir}/acks"
    acks: Receiver[Ack] = Receiver(ctx, acks_addr, Ack)
    sender: Sender | Publisher = (
        Sender(ctx, plans_addr, shm=True) if push else Publisher(ctx, plans_addr)
    )
    args = [sys.executable, "-m", "gapless.bench.plan_fanout", "--rank", plans_addr, acks_addr]
    procs = [subprocess.Popen([*args, *(["--push"] if push else [])]) for _ in range(ranks)]
    if isinstance(sender, Publisher):
        assert sender.wait_subscribers(ranks, 30_000), "the ranks did not subscribe"
    sends, trips = [], []
    for seq in range(1, steps + 1):
        plan = steady_plan(seq, batch)
        t0 = time.perf_counter()
        sender.send(plan)
        t1 = time.perf_counter()
        for _ in range(ranks):
            ack = acks.recv(timeout_ms=10_000)
            assert ack is not None and ack.seq == seq, ack
        t2 = time.perf_counter()
        if seq > steps // 10:  # the first tenth warms up
            sends.append((t1 - t0) * 1e6)
            trips.append((t2 - t0) * 1e6)
    sender.send(Shutdown())
    for p in procs:
        p.wait(10)
    sender.close()
    acks.close()
    ctx.term()
    os.rmdir(run_dir) if not os.listdir(run_dir) else None

    def p99(xs: list[float]) -> float:
        return sorted(xs)[int(len(xs) * 0.99)]

    return {"send_us": statistics.median(sends), "send_p99_us": p99(sends),
            "last_rank_us": statistics.median(trips), "last_rank_p99_us": p99(trips)}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="plan_fanout", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--rank", nargs=2, metavar=("PLANS", "ACKS"), help=argparse.SUPPRESS)
    p.add_argument("--push", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank:
        rank_main(*args.rank, args.push)
        return
    size = len(msgspec.msgpack.encode(steady_plan(1, args.batch)))
    print(f"steady decode of {args.batch} slots: a plan of {size} bytes, {args.steps} steps")
    rows = [("push (one runner)", 1, True)] + [(f"publish to {n}", n, False) for n in args.ranks]
    for name, n, push in rows:
        m = measure(n, args.batch, args.steps, push)
        print(f"{name:20} send {m['send_us']:6.1f} us (p99 {m['send_p99_us']:6.1f}), "
              f"last rank has it {m['last_rank_us']:6.1f} us (p99 {m['last_rank_p99_us']:6.1f})")  # fmt: skip


if __name__ == "__main__":
    main()
