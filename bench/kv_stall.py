"""`bench kv-stall`: what a KV event subscriber that stops reading costs the engine. One sim
server without events, then one with --kv-events-endpoint and a subscriber that connects and
never reads, each under the same load (N streams of distinct prompts, so every step stores
blocks); reports per-step host time (schedule + apply, ms, median and p99), device idle
fraction, the engine's resident memory after the run, and the dropped-batch counter.

bench kv-stall --streams 256 --seconds 10 -- --device sim
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from pathlib import Path
from statistics import median

import httpx
import zmq

from gapless.bench.launch import free_port, launched_server
from gapless.bench.serve_args import split_serve_args


def tree_rss_bytes(root_port: int) -> int:
    """Resident memory of every `gapless` process listening for this server's run (the serve
    process and its children), from /proc."""
    procs: dict[int, tuple[int, int]] = {}  # pid -> (ppid, rss bytes)
    page = os.sysconf("SC_PAGE_SIZE")
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            rss = int((d / "statm").read_text().split()[1]) * page
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        procs[int(d.name)] = (int(fields[1]), rss)
        if str(root_port).encode() in cmd and b"serve" in cmd:
            root = int(d.name)
    family = {root}
    grew = True
    while grew:
        grew = False
        for pid, (ppid, _) in procs.items():
            if ppid in family and pid not in family:
                family.add(pid)
                grew = True
    return sum(procs[p][1] for p in family if p in procs)


async def load(url: str, streams: int, seconds: float, prompt_len: int) -> int:
    """`streams` clients, each sending distinct prompts back to back until `seconds` pass."""
    deadline = time.monotonic() + seconds
    done = 0

    async def client(k: int, http: httpx.AsyncClient) -> None:
        nonlocal done
        i = 0
        while time.monotonic() < deadline:
            prompt = [1000 + (k * 7919 + i * 104729 + t) % 39000 for t in range(prompt_len)]
            body = {"model": "sim", "prompt": prompt, "max_tokens": 64, "ignore_eos": True}
            r = await http.post(url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            done += 1
            i += 1

    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        await asyncio.gather(*(client(k, http) for k in range(streams)))
    return done


def one_run(args: argparse.Namespace, serve_args: list[str], stalled: bool) -> dict:
    port = free_port()
    extra = ["--served-model-name", "sim", "--max-num-seqs", str(args.streams)]
    events = free_port()
    if stalled:
        extra += ["--kv-events-endpoint", str(events)]
    with launched_server([*extra, *serve_args], port=port) as url:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 1)
        sub.setsockopt(zmq.RCVBUF, 4096)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        if stalled:
            sub.connect(f"tcp://127.0.0.1:{events}")  # and never reads
        completed = asyncio.run(load(url, args.streams, args.seconds, args.prompt_len))
        timeline = httpx.get(url + "/v1/engine/timeline?last=8192", timeout=30).json()
        metrics = httpx.get(url + "/metrics", timeout=30).text
        rss = tree_rss_bytes(port)
        sub.close(0)
        ctx.destroy(0)
    steps = [s for s in timeline["steps"] if s["num_seqs"] > 0]
    host = sorted(s["schedule_ms"] + s["apply_ms"] for s in steps)
    dropped = re.search(r"^gapless_kv_events_dropped_batches_total\{[^}]*\} (\S+)$", metrics, re.M)
    return {
        "subscriber": "stalled" if stalled else "none (events off)",
        "completed": completed,
        "steps": len(steps),
        "host_ms_p50": round(median(host), 3),
        "host_ms_p99": round(host[int(0.99 * (len(host) - 1))], 3),
        "device_idle_fraction": round(timeline["summary"]["idle_fraction"], 4),
        "rss_mib": round(rss / 2**20, 1),
        "dropped_batches": float(dropped.group(1)) if dropped else None,
    }


def main(argv: list[str]) -> int:
    argv, serve_args = split_serve_args(argv) if "--" in argv else (argv, ["--device", "sim"])
    p = argparse.ArgumentParser(prog="bench kv-stall", description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    runs = [one_run(args, serve_args, stalled) for stalled in (False, True)]
    for r in runs:
        print(json.dumps(r))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"runs": runs, "serve_args": serve_args, "args": vars(args)}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
