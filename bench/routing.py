"""`bench route`: two gapless servers behind a router that sees only what an inference gateway
sees (each server's /metrics gauges and its KV events), against round robin, on a
shared-prefix workload. Reports each policy's cached-token share (prompt tokens the servers
reported as cached over all prompt tokens) and their ratio.

bench route --groups 12 --prefix 512 --requests 120 -- --device sim

The router keeps, per server, the set of blocks the server's events say it holds, keyed by its
own chain over the events' token ids (as Dynamo's router and llm-d's indexer in token mode
do; it never learns gapless's hashes' scope), and sends a request to the server holding the
longest prefix of its prompt, the one with fewer requests waiting on a tie. Prompts go as token
ids, so the router and the servers see the same tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import re
import sys
import threading
import time
from array import array
from contextlib import ExitStack
from dataclasses import dataclass, field

import httpx
import msgspec
import zmq

from gapless.bench.launch import free_port, launched_server
from gapless.bench.serve_args import split_serve_args

ROOT_KEY = b"router-root"


def chain(parent: bytes, tokens: list[int], block_size: int) -> list[bytes]:
    """The router's own name of each full block: a hash of its parent's name and its tokens."""
    out = []
    for i in range(0, len(tokens) // block_size * block_size, block_size):
        parent = hashlib.blake2b(parent + array("i", tokens[i : i + block_size]).tobytes(),
                                 digest_size=16).digest()  # fmt: skip
        out.append(parent)
    return out


@dataclass
class ServerView:
    """What the router knows of one server: its blocks (from events) and its gauges."""

    url: str
    events: str  # ZMQ PUB address
    names: dict[bytes, bytes] = field(default_factory=dict)  # server's hash -> router's name
    held: set[bytes] = field(default_factory=set)  # router's names of the server's blocks
    waiting: float = 0.0
    kv_usage: float = 0.0
    num_events: int = 0

    def apply(self, event: dict) -> None:
        self.num_events += 1
        kind = event.get("type")
        if kind == "BlockStored":
            parent = event["parent_block_hash"]
            root = ROOT_KEY if parent is None else self.names.get(parent)
            if root is None:  # its parent was never announced: nothing to chain on
                return
            mine = chain(root, event["token_ids"], event["block_size"])
            for theirs, name in zip(event["block_hashes"], mine, strict=True):
                self.names[theirs] = name
                self.held.add(name)
        elif kind == "BlockRemoved":
            for theirs in event["block_hashes"]:
                name = self.names.pop(theirs, None)
                if name is not None:
                    self.held.discard(name)
        elif kind == "AllBlocksCleared":
            self.names.clear()
            self.held.clear()

    def matched(self, names: list[bytes]) -> int:
        n = 0
        for name in names:
            if name not in self.held:
                break
            n += 1
        return n


def listen(views: list[ServerView], stop: threading.Event) -> None:
    """Apply every server's event batches as they come (a thread)."""
    ctx = zmq.Context.instance()
    socks = {}
    poller = zmq.Poller()
    for view in views:
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(view.events)
        socks[sock] = view
        poller.register(sock, zmq.POLLIN)
    decode = msgspec.msgpack.Decoder().decode
    while not stop.is_set():
        for sock, _ in poller.poll(50):
            _topic, _seq, payload = sock.recv_multipart()
            _ts, events, _rank = decode(payload)
            for event in events:
                # why both: vLLM before 0.26 sent positional arrays; gapless sends maps
                if isinstance(event, dict):
                    socks[sock].apply(event)
    for sock in socks:
        sock.close(0)


GAUGE = re.compile(
    r"^(gapless_requests_waiting|gapless_kv_cache_usage_ratio)\{[^}]*\} (\S+)$", re.M
)


async def scrape(client: httpx.AsyncClient, views: list[ServerView], stop: asyncio.Event) -> None:
    """The gauges an endpoint picker reads, every 50 ms."""
    while not stop.is_set():
        for view in views:
            text = (await client.get(view.url + "/metrics")).text
            for name, value in GAUGE.findall(text):
                if name == "gapless_requests_waiting":
                    view.waiting = float(value)
                else:
                    view.kv_usage = float(value)
        await asyncio.sleep(0.05)


def workload(groups: int, prefix: int, suffix: int, requests: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000, 40000) for _ in range(prefix)] for _ in range(groups)]
    order = [rng.randrange(groups) for _ in range(requests)]
    return [prefixes[g] + [rng.randrange(1000, 40000) for _ in range(suffix)] for g in order]


async def drive(policy: str, views: list[ServerView], prompts: list[list[int]], block_size: int,
                concurrency: int, max_tokens: int) -> dict:  # fmt: skip
    """Send every prompt, `concurrency` at a time, to the server the policy picks."""
    stop = asyncio.Event()
    counts = {"prompt": 0, "cached": 0, "failed": 0}
    picks = [0] * len(views)
    next_rr = 0
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=120) as client:
        scraper = asyncio.create_task(scrape(client, views, stop))

        def pick(tokens: list[int]) -> int:
            nonlocal next_rr
            if policy == "round-robin":
                next_rr = (next_rr + 1) % len(views)
                return next_rr
            names = chain(ROOT_KEY, tokens, block_size)
            return max(range(len(views)),
                       key=lambda k: (views[k].matched(names), -views[k].waiting,
                                      -views[k].kv_usage))  # fmt: skip

        async def one(tokens: list[int]) -> None:
            async with gate:
                k = pick(tokens)
                picks[k] += 1
                body = {"model": "sim", "prompt": tokens, "max_tokens": max_tokens}
                r = await client.post(views[k].url + "/v1/completions", json=body)
                if r.status_code != 200:
                    counts["failed"] += 1
                    return
                usage = r.json()["usage"]
                counts["prompt"] += usage["prompt_tokens"]
                details = usage.get("prompt_tokens_details") or {}
                counts["cached"] += details.get("cached_tokens") or 0

        t0 = time.monotonic()
        await asyncio.gather(*(one(p) for p in prompts))
        stop.set()
        await scraper
    return {
        "policy": policy,
        "prompt_tokens": counts["prompt"],
        "cached_tokens": counts["cached"],
        "cached_share": counts["cached"] / max(1, counts["prompt"]),
        "failed": counts["failed"],
        "requests_per_server": picks,
        "events_seen": [v.num_events for v in views],
        "duration_s": round(time.monotonic() - t0, 2),
    }


def run_policy(policy: str, args: argparse.Namespace, serve_args: list[str]) -> dict:
    """Two fresh servers (empty caches), the workload through one policy."""
    prompts = workload(args.groups, args.prefix, args.suffix, args.requests, args.seed)
    with ExitStack() as stack:
        views = []
        for _ in range(2):
            events = free_port()
            url = stack.enter_context(launched_server(
                ["--served-model-name", "sim", "--kv-events-endpoint", str(events), *serve_args]
            ))  # fmt: skip
            views.append(ServerView(url, f"tcp://127.0.0.1:{events}"))
        stop = threading.Event()
        listener = threading.Thread(target=listen, args=(views, stop), daemon=True)
        listener.start()
        time.sleep(0.3)  # why: a SUB socket misses what is sent before it joined
        try:
            return asyncio.run(drive(policy, views, prompts, args.block_size, args.concurrency,
                                     args.max_tokens))  # fmt: skip
        finally:
            stop.set()
            listener.join(2)


def main(argv: list[str]) -> int:
    argv, serve_args = split_serve_args(argv) if "--" in argv else (argv, ["--device", "sim"])
    p = argparse.ArgumentParser(prog="bench route", description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=12, help="distinct shared prefixes")
    p.add_argument("--prefix", type=int, default=512, help="tokens of each shared prefix")
    p.add_argument("--suffix", type=int, default=32, help="tokens of each request's own tail")
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16, help="the servers' --block-size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    runs = [run_policy(policy, args, serve_args) for policy in ("round-robin", "kv-events")]
    rr, kv = runs
    ratio = kv["cached_share"] / rr["cached_share"] if rr["cached_share"] else float("inf")
    for r in runs:
        print(f"{r['policy']:>12}: cached share {r['cached_share']:.3f} "
              f"({r['cached_tokens']} of {r['prompt_tokens']} prompt tokens), "
              f"requests per server {r['requests_per_server']}, failed {r['failed']}, "
              f"{r['duration_s']} s")  # fmt: skip
    print(f"kv-events / round-robin cached share: {ratio:.2f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"runs": runs, "ratio": ratio, "serve_args": serve_args,
                       "workload": vars(args)}, f, indent=2)  # fmt: skip
    return 0 if not any(r["failed"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
