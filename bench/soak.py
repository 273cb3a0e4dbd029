"""`make soak` / `python -m gapless.bench.soak`: a long run of `gapless serve` near capacity with
cancellations, then a killed role.

1. Starts `gapless serve` (sim by default) and keeps ~80% of its seats busy (closed loop:
   `--load` x `--max-num-seqs` streams at once) with random prompt and output lengths; 10% of
   the streams are cancelled by their client after a random number of events.
2. Reports requests, errors (anything but a clean end or a planned cancel), leaked KV blocks
   (held once the load stopped and the engine went idle) and RSS per process (after warm-up,
   at the end, the drift in %).
   With `--hostile N`, N more clients send what a hostile one would (bench/hostile.py: schemas
   that never compile, 3 MB prompts, bad JSON, streams never read) the whole time: each must be
   refused or cut, the well-behaved streams must see no error, and the server's counters must
   match what the clients saw (requests rejected, slow clients, aborts).
3. Starts streams again, SIGKILLs a random role (runner, core, detokenizer or the supervisor),
   and checks every stream in flight ended with an error event, that every process exited, and
   that nothing of the run is left in /dev/shm or the temp directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from gapless.bench.hostile import HostileTally, hostile_worker

ROLES = {"runner": "gapless-runner", "core": "gapless-core", "detokenizer": "gapless-detok"}


@dataclass
class Tally:
    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    tokens: int = 0

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(what[:300])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> dict[str, int]:
    out = subprocess.run(["ps", "-o", "pid=,comm=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout  # fmt: skip
    return {comm.strip(): int(p) for p, comm in (line.split(None, 1) for line in out.splitlines())}


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, IndexError):
        return False


async def _one(client: httpx.AsyncClient, tally: Tally, rng: random.Random, cancel_p: float,
               max_tokens: int) -> str:  # fmt: skip
    """One streamed request; returns how it ended: done, cancelled, error or transport."""
    body = {
        "model": "soak",
        "prompt": " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(
            rng.randint(8, 400))),
        "max_tokens": rng.randint(max_tokens // 4, max_tokens),
        "ignore_eos": True,
        "stream": True,
    }  # fmt: skip
    cancel_after = rng.randint(1, 50) if rng.random() < cancel_p else None
    tally.requests += 1
    events = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                tally.error(f"HTTP {r.status_code}: {(await r.aread()).decode()}")
                return "error"
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    tally.completed += 1
                    return "done"
                if line.startswith('data: {"error"'):  # an error event, not a token's text
                    tally.error(line)
                    return "error"
                events += 1
                tally.tokens += 1
                if cancel_after is not None and events >= cancel_after:
                    tally.cancelled += 1
                    return "cancelled"
    except httpx.HTTPError as e:
        tally.error(f"transport: {e!r}")
        return "transport"
    tally.error("stream ended without [DONE]")
    return "error"


async def _load(url: str, streams: int, until: float, tally: Tally, seed: int, cancel_p: float,
                max_tokens: int) -> None:  # fmt: skip
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def worker(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while time.monotonic() < until:
                await _one(client, tally, rng, cancel_p, max_tokens)

        await asyncio.gather(*(worker(i) for i in range(streams)))


async def _kill_phase(url: str, streams: int, victim_pid: int, seed: int, max_tokens: int) -> dict:
    """Streams in flight, then SIGKILL of victim_pid: how each stream ended."""
    ends: list[str] = []
    tally = Tally()
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        rng = random.Random(seed)

        async def one() -> None:
            ends.append(await _one(client, tally, rng, 0.0, max_tokens * 20))

        tasks = [asyncio.ensure_future(one()) for _ in range(streams)]
        await asyncio.sleep(2.0)
        os.kill(victim_pid, signal.SIGKILL)
        killed = time.monotonic()
        await asyncio.wait(tasks, timeout=30)
        took = time.monotonic() - killed
    return {"in_flight": streams, "ends": {e: ends.count(e) for e in set(ends)},
            "all_ended_s": round(took, 2), "samples": tally.error_samples[:2]}  # fmt: skip


def _counters(text: str) -> dict[str, float]:
    """Totals of the counters the clients can check, summed over their labels."""
    names = {
        "gapless_requests_rejected_total": "rejected",
        "gapless_slow_clients_total": "slow_clients",
        "gapless_requests_aborted_total": "aborted",
    }
    out = dict.fromkeys(
        [*names.values(), "finished_length", "finished_abort", "finished_other"], 0.0
    )
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        value = float(line.rsplit(" ", 1)[1]) if name and not name.startswith("#") else 0.0
        if name in names:
            out[names[name]] += value
        elif name == "gapless_requests_finished_total":
            reason = line.split('finish_reason="', 1)[1].split('"', 1)[0]
            out[f"finished_{reason if reason in ('length', 'abort') else 'other'}"] += value
    return out


def _counters_exact(counters: dict[str, float], tally: Tally, hostile: HostileTally) -> dict:
    """The counters against what the clients saw. Exact: every 4xx a client got was counted as
    rejected, every cut non-reader as a slow client, and every request that reached the engine
    ended there by length or abort (the load asks ignore_eos). Bounds, as a disconnect races
    the end: a client may cancel after the engine finished its request (it was still reading),
    and the frontend may see a disconnect after the engine's last delta; so the engine's aborts
    are at most the frontend's disconnects and cuts, and those at most the cancels and cuts."""
    c = counters
    cut = sum(n for o in hostile.outcomes.values() for k, n in o.items() if k.startswith("cut"))
    reached = tally.completed + tally.cancelled + cut
    return {
        "rejected": c["rejected"] == hostile.refused(),
        "slow_clients": c["slow_clients"] == cut,
        "engine_finished": c["finished_length"] + c["finished_abort"] == reached
        and c["finished_other"] == 0,
        "engine_aborts": c["finished_abort"] <= c["aborted"] + c["slow_clients"],
        "disconnects": c["aborted"] <= tally.cancelled,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of load (default 1800)")
    p.add_argument("--warmup", type=float, default=None, help="seconds before the RSS baseline "
                   "(default: a tenth of --duration, at least 30)")  # fmt: skip
    p.add_argument("--load", type=float, default=0.8, help="share of the seats kept busy")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=256, help="the longest output asked for")
    p.add_argument("--cancel", type=float, default=0.1, help="share of streams cancelled")
    p.add_argument("--kill", choices=[*ROLES, "supervisor", "random"], default="random")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hostile", type=int, default=0, metavar="N",
                   help="hostile clients beside the load (bench/hostile.py)")  # fmt: skip
    p.add_argument("--write-timeout", type=float, default=5.0,
                   help="the server's --stream-write-timeout (s)")  # fmt: skip
    p.add_argument("--output-json", type=Path)
    p.add_argument("serve_args", nargs="*", help="extra `gapless serve` flags (after --)")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    warmup = args.warmup if args.warmup is not None else max(30.0, args.duration / 10)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    serve = [sys.executable, "-m", "gapless.launch.cli", "serve", "--port", str(port),
             "--device", "sim", "--served-model-name", "soak", "--max-num-seqs",
             str(args.max_num_seqs), "--log-level", "warning", "--stream-write-timeout",
             str(args.write_timeout), *args.serve_args]  # fmt: skip
    proc = subprocess.Popen(serve, stdin=subprocess.DEVNULL)
    report: dict = {"device": "sim", "serve": serve[3:]}
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        else:
            raise SystemExit("gapless serve did not become healthy")
        run_dir = next(Path(tempfile.gettempdir()).glob(f"gapless-{proc.pid}-*"))
        procs = {"supervisor": proc.pid, **_children(proc.pid)}
        streams = max(1, round(args.load * args.max_num_seqs))
        tally, hostile = Tally(), HostileTally()
        start = time.monotonic()
        baseline: dict[str, int] = {}
        # a non-reader looks for its cut after this: its buffers fill, then the write timeout
        hold_s = args.write_timeout + 10.0

        async def soak() -> None:
            until = start + args.duration
            load = asyncio.ensure_future(_load(url, streams, until, tally, args.seed,
                                               args.cancel, args.max_tokens))  # fmt: skip
            attacks = [
                asyncio.ensure_future(hostile_worker(url, "soak", until, hostile, i, hold_s))
                for i in range(args.hostile)
            ]
            await asyncio.sleep(min(warmup, args.duration))
            baseline.update({n: _rss_kib(pid) for n, pid in procs.items()})
            await asyncio.gather(load, *attacks)

        asyncio.run(soak())
        end_rss = {n: _rss_kib(pid) for n, pid in procs.items()}
        time.sleep(1.0)  # the last aborts reach the core
        stats = httpx.get(url + "/v1/engine/stats", timeout=10).json()
        counters = _counters(httpx.get(url + "/metrics", timeout=10).text)
        report["soak"] = {
            **asdict(tally),
            "hostile": hostile.summary(),
            "counters": counters,
            "counters_exact": _counters_exact(counters, tally, hostile),
            "duration_s": round(time.monotonic() - start, 1),
            "streams": streams,
            "requests_per_s": round(tally.requests / args.duration, 2),
            "leaked_kv_blocks": stats["num_total_blocks"] - stats["num_free_blocks"],
            "left_running": stats["num_running"],
            "left_waiting": stats["num_waiting"],
            "rss_kib_after_warmup": baseline,
            "rss_kib_end": end_rss,
            "rss_drift_pct": {
                n: round(100 * (end_rss[n] - baseline[n]) / baseline[n], 2)
                for n in baseline
                if baseline[n]
            },  # fmt: skip
        }
        victim = rng.choice([*ROLES, "supervisor"]) if args.kill == "random" else args.kill
        pid = proc.pid if victim == "supervisor" else procs[ROLES[victim]]
        kill = asyncio.run(_kill_phase(url, streams, pid, args.seed + 1, args.max_tokens))
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in procs.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        run_id = run_dir.name.removeprefix("gapless-")  # other runs on the machine are not ours
        leftover_shm = sorted(p.name for p in Path("/dev/shm").glob(f"gapless-{run_id}-*"))
        report["kill"] = {
            "role": victim,
            **kill,
            "processes_left": [n for n, p in procs.items() if _alive(p)],
            "run_dir_left": run_dir.exists(),
            "shm_left": leftover_shm,
        }
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    s, k = report["soak"], report["kill"]
    hostile_ok = all(
        set(outcomes) <= {"400", "413", "429", "cut", "cut_unread", "closed_silently", "closed_408"}
        for outcomes in s["hostile"]["outcomes"].values()
    )
    ok = (
        s["errors"] == 0
        and hostile_ok
        and all(s["counters_exact"].values())
        and all(abs(d) <= 10.0 for d in s["rss_drift_pct"].values())
        and s["leaked_kv_blocks"] == 0
        and set(k["ends"]) <= {"error"}
        and not k["processes_left"]
        and not k["run_dir_left"]
        and not k["shm_left"]
    )
    report["ok"] = ok
    text = json.dumps(report, indent=2)
    print(text)
    if args.output_json:
        args.output_json.write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
