"""`bench sse-ceiling`: how many tokens/s the frontends deliver to streaming clients when the
engine is never the limit.

For each N in --api-servers, starts N real frontend processes (as `gapless serve
--api-servers N` does, sharing one port) in front of bench/flood.py instead of the engine: it
sends one token for every live request every --step-ms, as a decode step of the whole batch
would. --streams clients send /v1/completions requests of --output-len tokens at once and read
their SSE streams (aiohttp on uvloop, this process); each client checks that its text is the
tokens 0..output-len-1 in order. Whatever a client is behind on comes coalesced, several
tokens to an event. Reported per N: tokens/s and events/s received (first token to last),
tokens sent and received, and the CPU of the frontends, the clients and the flood, in cores,
so the reader sees who was the limit (they share the machine's cores).

    bench sse-ceiling --streams 256 --api-servers 1,2 --output-json sse.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import msgspec
import uvloop

from gapless.bench.host_floor import positive_ints
from gapless.bench.launch import free_port
from gapless.common.channel import Sender
from gapless.common.config import CONFIG_ENV, EngineConfig, encode_config
from gapless.common.messages import Shutdown
from gapless.common.metrics import MULTIPROC_ENV
from gapless.common.model_cache import default_model_path
from gapless.common.model_files import resolve_model
from gapless.common.process import CORE_IN
from gapless.launch.supervisor import Supervisor, make_run_dir

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class StreamResult:
    tokens: list[int] = field(default_factory=list)  # the token numbers read, in order
    num_events: int = 0  # SSE data events carrying text
    first_s: float = 0.0  # perf_counter of the first and the last token
    last_s: float = 0.0
    usage_tokens: int | None = None  # completion_tokens of the usage chunk
    error: str = ""


@dataclass(frozen=True)
class Run:
    api_servers: int
    streams: int
    output_len: int
    step_ms: float
    offered_tokens_per_s: float  # what the flood would send if nothing lagged
    tokens_sent: int
    tokens_received: int
    in_order: bool  # every stream read 0..k-1 with nothing lost, repeated or out of place
    failed: int  # streams that ended without all their tokens
    num_events: int
    window_s: float  # first token to last, over all streams
    tokens_per_s: float
    events_per_s: float
    tokens_per_event: float
    frontend_cpu: float  # cores, all frontends together, over the window
    client_cpu: float  # cores: this process
    flood_cpu: float  # cores, from its first step to its last
    flood_late_steps: int
    errors: list[str]


class _Choice(msgspec.Struct):
    text: str = ""


class _Usage(msgspec.Struct):
    completion_tokens: int = 0


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None


_chunk = msgspec.json.Decoder(_Chunk)


async def read_stream(session: aiohttp.ClientSession, url: str, body: dict) -> StreamResult:
    """One streaming request; its text's tokens as numbers, and when they came."""
    result = StreamResult()
    pieces: list[str] = []
    try:
        await _read(session, url, body, result, pieces)
    except (aiohttp.ClientError, TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    result.tokens = [int(t) for t in "".join(pieces).split()]
    return result


async def _read(
    session: aiohttp.ClientSession, url: str, body: dict, result: StreamResult, pieces: list[str]
) -> None:
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            return
        rest = b""
        async for data in resp.content.iter_any():
            now = time.perf_counter()
            events = (rest + data).split(b"\n\n")
            rest = events.pop()
            for event in events:
                if not event.startswith(b"data: ") or event == b"data: [DONE]":
                    continue
                chunk = _chunk.decode(event[6:])
                if chunk.usage is not None:
                    result.usage_tokens = chunk.usage.completion_tokens
                text = "".join(c.text for c in chunk.choices)
                if text:
                    pieces.append(text)
                    result.num_events += 1
                    result.first_s = result.first_s or now
                    result.last_s = now


async def run_clients(port: int, model: str, streams: int, output_len: int) -> list[StreamResult]:
    url = f"http://127.0.0.1:{port}/v1/completions"
    body = {
        "model": model,
        "prompt": "hi",
        "max_tokens": output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    timeout = aiohttp.ClientTimeout(total=600.0, connect=30.0)
    connector = aiohttp.TCPConnector(limit=streams)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        return await asyncio.gather(*(read_stream(session, url, body) for _ in range(streams)))


def _cpu_s(pid: int) -> float:
    """utime + stime of a live process, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def measure(api_servers: int, streams: int, output_len: int, step_ms: float) -> Run:
    """One run: a flood and N frontends up, the clients' requests at once, everything down."""
    config = EngineConfig(
        model=resolve_model(str(default_model_path())),
        served_model_name="flood",
        api_servers=api_servers,
        port=free_port(),
        run_dir=make_run_dir(),
        log_level="warning",  # no access line per request
    )
    sup = Supervisor(config)
    result_path = Path(tempfile.mkstemp(prefix="gapless-flood-", suffix=".json")[1])
    try:
        env = dict(os.environ, **_child_env(config, sup.metrics_dir))
        sup.procs["flood"] = subprocess.Popen(
            [sys.executable, "-m", "gapless.bench.flood", str(step_ms), str(result_path)],
            env=env,
            stdin=subprocess.DEVNULL,
        )
        sup.wait_ready(["flood"])
        for i in range(api_servers):
            sup.spawn("frontend", str(i))
        sup.wait_ready([f"frontend{i}" for i in range(api_servers)])
        fronts = [p.pid for n, p in sup.procs.items() if n.startswith("frontend")]
        cpu0, client0 = sum(_cpu_s(pid) for pid in fronts), time.process_time()
        results = uvloop.run(run_clients(config.port, "flood", streams, output_len))
        cpu1, client1 = sum(_cpu_s(pid) for pid in fronts), time.process_time()
        stop: Sender = Sender(sup.ctx, config.engine_ipc(CORE_IN))
        stop.send(Shutdown())
        stop.socket.close(linger=500)
        sup.procs["flood"].wait(30)
        flood = json.loads(result_path.read_text())
        sup.stop_frontends(10)
    finally:
        sup.close()
        result_path.unlink(missing_ok=True)
    return summarize(
        api_servers, streams, output_len, step_ms, results, flood, cpu1 - cpu0, client1 - client0
    )


def _child_env(config: EngineConfig, metrics_dir: str) -> dict[str, str]:
    return {CONFIG_ENV: encode_config(config), MULTIPROC_ENV: metrics_dir}


def summarize(
    api_servers: int,
    streams: int,
    output_len: int,
    step_ms: float,
    results: list[StreamResult],
    flood: dict,
    frontend_cpu_s: float,
    client_cpu_s: float,
) -> Run:
    got = [r for r in results if r.tokens]
    window = max(r.last_s for r in got) - min(r.first_s for r in got) if got else 0.0
    received = sum(len(r.tokens) for r in results)
    events = sum(r.num_events for r in results)
    in_order = all(r.tokens == list(range(len(r.tokens))) for r in results)
    failed = sum(1 for r in results if len(r.tokens) != output_len or r.error)
    per_s = 1.0 / window if window > 0 else 0.0
    return Run(
        api_servers=api_servers,
        streams=streams,
        output_len=output_len,
        step_ms=step_ms,
        offered_tokens_per_s=streams * 1e3 / step_ms,
        tokens_sent=sum(flood["sent"].values()),
        tokens_received=received,
        in_order=in_order,
        failed=failed,
        num_events=events,
        window_s=window,
        tokens_per_s=received * per_s,
        events_per_s=events * per_s,
        tokens_per_event=received / events if events else 0.0,
        frontend_cpu=frontend_cpu_s * per_s,
        client_cpu=client_cpu_s * per_s,
        flood_cpu=flood["cpu"],
        flood_late_steps=flood["num_late_steps"],
        errors=sorted({r.error for r in results if r.error})[:5],
    )


def format_table(runs: list[Run]) -> str:
    head = (
        f"{'api servers':>11} {'tokens/s':>10} {'events/s':>10} {'tok/event':>9} "
        f"{'sent':>9} {'received':>9} {'ordered':>7} {'failed':>6} "
        f"{'frontend CPU':>12} {'client CPU':>10} {'flood CPU':>9}"
    )
    rows = [head]
    for r in runs:
        rows.append(
            f"{r.api_servers:>11} {r.tokens_per_s:>10,.0f} {r.events_per_s:>10,.0f} "
            f"{r.tokens_per_event:>9.2f} {r.tokens_sent:>9} {r.tokens_received:>9} "
            f"{'yes' if r.in_order else 'NO':>7} {r.failed:>6} "
            f"{r.frontend_cpu:>12.2f} {r.client_cpu:>10.2f} {r.flood_cpu:>9.2f}"
        )
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench sse-ceiling",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--streams", type=int, default=256, help="streaming clients (default: 256)")
    p.add_argument("--output-len", type=int, default=2048, help="tokens per stream (default: 2048)")
    p.add_argument(
        "--step-ms",
        type=float,
        default=1.0,
        help="ms between the flood's steps, one token per live stream each (default: 1.0)",
    )
    p.add_argument(
        "--api-servers",
        type=positive_ints,
        default=[1, 2],
        metavar="N[,N...]",
        help="frontend processes, one run each (default: 1,2)",
    )
    p.add_argument("--output-json", help="write the runs here")
    return p


def main(argv: list[str]) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.streams < 1:
        parser.error("--streams must be >= 1")
    if args.output_len < 1:
        parser.error("--output-len must be >= 1")
    if args.step_ms <= 0:
        parser.error("--step-ms must be > 0")
    load = os.getloadavg()
    runs = []
    for n in args.api_servers:
        runs.append(measure(n, args.streams, args.output_len, args.step_ms))
        table = format_table(runs[-1:]).splitlines()
        print("\n".join(table if len(runs) == 1 else table[1:]), flush=True)
    print(
        f"\n{args.streams} streams x {args.output_len} tokens, a flood step every "
        f"{args.step_ms:g} ms (offered {runs[0].offered_tokens_per_s:,.0f} tokens/s); "
        f"load average before: {load[0]:.2f}; CPU in cores over the window"
    )
    if args.output_json:
        out = {
            "streams": args.streams,
            "output_len": args.output_len,
            "step_ms": args.step_ms,
            "load_average": load[0],
            "runs": [asdict(r) for r in runs],
        }
        Path(args.output_json).write_text(json.dumps(out, indent=2))
        print(f"wrote {args.output_json}")
