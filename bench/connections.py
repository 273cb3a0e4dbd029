"""`bench connections`: a server held by idle and slowloris connections, beside a normal client.

bench connections --idle 20000 --slowloris 100 --seconds 60 --launch -- --device sim

Opens `--idle` connections that never send a byte (spread over helper processes, so no one
process needs 20,000 descriptors) and `--slowloris` ones that send a request head a byte every
`--drip` seconds, then, for `--seconds`, asks `/health` and one short completion each
`--every` seconds as a normal client would. It reports each normal request's status and time,
how long the server took to close the idle and slow connections, and what it answered them; it
exits 1 if a normal request failed. The server's bounds are its --header-timeout and
--max-connections (README, "Operating it").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

from gapless.bench.hostile import held_connection
from gapless.bench.launch import launched_server
from gapless.bench.serve_args import split_serve_args

PER_PROCESS = 8000  # idle sockets one helper process holds (under a 20,000 descriptor limit)


@dataclass
class Held:
    """Connections of one kind: when the server closed each (s after it opened) and what it
    wrote before closing."""

    opened: int = 0
    failed_to_open: int = 0
    closed_after_s: list[float] = field(default_factory=list)
    answers: dict[str, int] = field(default_factory=dict)
    still_open: int = 0

    def summary(self) -> dict:
        after = sorted(self.closed_after_s)
        return {
            "opened": self.opened,
            "failed_to_open": self.failed_to_open,
            "closed": len(after),
            "still_open": self.still_open,
            "closed_after_s": {
                "p50": round(after[len(after) // 2], 2) if after else None,
                "max": round(after[-1], 2) if after else None,
            },
            "answers": self.answers,
        }


async def _hold(host: str, port: int, drip_s: float | None, limit_s: float, held: Held) -> None:
    outcome, took = await held_connection(host, port, drip_s, limit_s)
    if outcome == "connect_failed":
        held.failed_to_open += 1
        return
    held.opened += 1
    if outcome == "still_open":
        held.still_open += 1
        return
    held.closed_after_s.append(took)
    answer = outcome.removeprefix("closed_")
    held.answers[answer] = held.answers.get(answer, 0) + 1


async def _hold_many(host: str, port: int, n: int, drip_s: float | None, seconds: float) -> Held:
    held, tasks = Held(), []
    for _ in range(n):
        tasks.append(asyncio.create_task(_hold(host, port, drip_s, seconds, held)))
        await asyncio.sleep(0)  # why: connect in a stream, not one burst past the listen backlog
    await asyncio.gather(*tasks)
    return held


def _helper(argv: list[str]) -> None:
    """python -m gapless.bench.connections --helper HOST PORT N SECONDS: holds N idle
    connections and prints their Held as JSON."""
    host, port, n, seconds = argv[0], int(argv[1]), int(argv[2]), float(argv[3])
    _raise_descriptor_limit()
    held = asyncio.run(_hold_many(host, port, n, None, seconds))
    print(json.dumps(asdict(held)))


def _raise_descriptor_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def _normal(url: str, model: str, seconds: float, every_s: float) -> dict:
    """/health and one short completion every `every_s` seconds, as a well-behaved client."""
    results: dict[str, list] = {"health": [], "completion": []}
    errors: list[str] = []
    until = time.monotonic() + seconds
    body = {"model": model, "prompt": "Say hi", "max_tokens": 4}
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while time.monotonic() < until:
            for name, send in (("health", lambda: client.get("/health")),
                               ("completion", lambda: client.post("/v1/completions", json=body))):  # fmt: skip
                start = time.monotonic()
                try:
                    r = await send()
                    results[name].append((r.status_code, time.monotonic() - start))
                    if r.status_code != 200:
                        errors.append(f"{name}: {r.status_code} {r.text[:200]}")
                except httpx.HTTPError as e:
                    results[name].append((None, time.monotonic() - start))
                    errors.append(f"{name}: {type(e).__name__}: {e}")
            await asyncio.sleep(every_s)
    out = {}
    for name, got in results.items():
        times = sorted(t for _, t in got)
        out[name] = {
            "sent": len(got),
            "ok": sum(1 for s, _ in got if s == 200),
            "p50_ms": round(1e3 * statistics.median(times), 1) if times else None,
            "max_ms": round(1e3 * times[-1], 1) if times else None,
        }
    out["errors"] = errors[:20]
    return out


async def _run(url: str, args: argparse.Namespace) -> dict:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
    hold_s = args.seconds + 30  # the helpers outlast the normal client, so the server's closes show
    helpers = []
    left = args.idle
    while left > 0:
        n = min(PER_PROCESS, left)
        left -= n
        helpers.append(subprocess.Popen(
            [sys.executable, "-m", "gapless.bench.connections", "--helper", host, port, str(n),
             str(hold_s)], stdout=subprocess.PIPE, text=True))  # fmt: skip
    slow = asyncio.create_task(_hold_many(host, int(port), args.slowloris, args.drip, hold_s))
    await asyncio.sleep(args.ramp)  # the idle ones connect
    normal = await _normal(url, model, args.seconds, args.every)
    slow_held = await slow
    idle = Held()
    for proc in helpers:
        out, _ = await asyncio.to_thread(proc.communicate)
        part = Held(**json.loads(out))
        idle.opened += part.opened
        idle.failed_to_open += part.failed_to_open
        idle.closed_after_s += part.closed_after_s
        idle.still_open += part.still_open
        for k, v in part.answers.items():
            idle.answers[k] = idle.answers.get(k, 0) + v
    return {"idle": idle.summary(), "slowloris": slow_held.summary(), "normal": normal}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--helper"]:
        _helper(argv[1:])
        return 0
    p = argparse.ArgumentParser(prog="bench connections", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--launch", action="store_true", help="start `gapless serve` with the "
                   "arguments after --")  # fmt: skip
    p.add_argument("--idle", type=int, default=20_000, help="connections that send nothing")
    p.add_argument("--slowloris", type=int, default=100, help="connections dripping a head")
    p.add_argument("--drip", type=float, default=2.0, help="seconds between a slow head's bytes")
    p.add_argument("--seconds", type=float, default=60.0, help="how long the normal client runs")
    p.add_argument("--every", type=float, default=0.5, help="seconds between its requests")
    p.add_argument("--ramp", type=float, default=5.0, help="seconds the idle ones get to connect")
    p.add_argument("--output-json", help="write the report here too")
    own, serve_args = split_serve_args(argv)
    args = p.parse_args(own)
    _raise_descriptor_limit()
    if args.launch:
        with launched_server(serve_args) as url:
            report = asyncio.run(_run(url, args))
    else:
        report = asyncio.run(_run(args.base_url, args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(text + "\n")
    normal = report["normal"]
    return 0 if not normal["errors"] and normal["health"]["sent"] else 1


if __name__ == "__main__":
    sys.exit(main())
