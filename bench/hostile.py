"""Hostile clients for the soak (bench/soak.py `--hostile N`): each request is one a careless or
malicious client sends, and each must cost the server a bounded refusal, never harm to others.

Kinds, taken in turn by each hostile worker:
- `schema`: a chat request whose json_schema never finishes compiling (an allOf of search
  patterns): refused with a 400 (or 429 while the compile slots are full);
- `long_prompt`: a 3 MB text prompt: refused before tokenizing;
- `bad_json`: a truncated body and a 2,000-deep array: refused with a 400;
- `non_reader`: a stream whose client never reads, its receive buffer small: the server must cut
  it within its write timeout and end it with an error event;
- `idle`: a connection that sends nothing: closed without a word at the server's
  --header-timeout;
- `slowloris`: a request head sent a byte every SLOW_DRIP_S: a 408 and closed at
  --header-timeout.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

KINDS = ("schema", "long_prompt", "bad_json", "non_reader", "idle", "slowloris")
LONG_PROMPT_CHARS = 3 * 2**20
RCVBUF_BYTES = 4096  # the never-reading client's socket buffer: what it "holds" of the stream
SLOW_DRIP_S = 2.0  # a slowloris head's seconds between bytes
HOLD_LIMIT_S = 120.0  # how long an idle or slowloris connection waits to be closed


@dataclass
class HostileTally:
    """Per kind, how each hostile request ended (an HTTP status, `cut`, or what went wrong)."""

    outcomes: dict[str, Counter] = field(default_factory=lambda: {k: Counter() for k in KINDS})
    cut_s: list[float] = field(default_factory=list)  # non_reader: request sent to its cut seen
    held_s: list[float] = field(default_factory=list)  # idle, slowloris: open to closed

    def add(self, kind: str, outcome: str) -> None:
        self.outcomes[kind][outcome] += 1

    def summary(self) -> dict:
        cut = sorted(self.cut_s)
        return {
            "outcomes": {k: dict(v) for k, v in self.outcomes.items()},
            "non_reader_seen_cut_by_s": round(cut[-1], 2) if cut else None,
            "idle_and_slowloris_closed_by_s": round(max(self.held_s), 2) if self.held_s else None,
        }

    def refused(self) -> int:
        """Requests answered with a 4xx: each one the server must have counted as rejected."""
        return sum(n for c in self.outcomes.values() for o, n in c.items() if o.startswith("4"))


def runaway_schema(i: int) -> dict:
    parts = [{"type": "string", "pattern": f".*a{j}s{i}.*"} for j in range(30)]
    return {"type": "string", "allOf": parts}


async def _schema(client: httpx.AsyncClient, model: str, i: int) -> str:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": runaway_schema(i)},
        },
    }
    r = await client.post("/v1/chat/completions", json=body)
    return str(r.status_code)


async def _long_prompt(client: httpx.AsyncClient, model: str, i: int) -> str:
    body = {"model": model, "prompt": "lorem ipsum " * (LONG_PROMPT_CHARS // 12), "max_tokens": 4}
    r = await client.post("/v1/completions", json=body)
    return str(r.status_code)


async def _bad_json(client: httpx.AsyncClient, model: str, i: int) -> str:
    raw = b'{"model": "x", "prompt": "a' if i % 2 else b"[" * 2000 + b"]" * 2000
    r = await client.post(
        "/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    return str(r.status_code)


async def held_connection(
    host: str, port: int, drip_s: float | None, limit_s: float = HOLD_LIMIT_S
) -> tuple[str, float]:
    """A connection that sends nothing (drip_s None) or a request head a byte every drip_s,
    until the server closes it or limit_s pass: `closed_silently`, `closed_408` (or the
    status it wrote), `still_open` or `connect_failed`, and the seconds it was open."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, (host, port))
    except OSError:
        sock.close()
        return "connect_failed", 0.0
    opened, got = time.monotonic(), b""
    head = iter(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 10**6)
    try:
        while True:
            if time.monotonic() - opened > limit_s:
                return "still_open", time.monotonic() - opened
            if drip_s is not None:
                await loop.sock_sendall(sock, bytes([next(head)]))
            try:
                data = await asyncio.wait_for(loop.sock_recv(sock, 4096), drip_s or 1.0)
            except asyncio.TimeoutError:
                continue
            got += data
            if not data:
                break
    except (ConnectionResetError, BrokenPipeError):
        pass
    finally:
        sock.close()
    took = time.monotonic() - opened
    if not got:
        return "closed_silently", took
    return "closed_" + (got[9:12].decode("latin-1") if got.startswith(b"HTTP/") else "?"), took


async def non_reader(
    host: str, port: int, model: str, hold_s: float, max_tokens: int = 8000
) -> tuple[str, float]:
    """A stream whose client reads nothing for hold_s, then reads what is there: `cut` when the
    server had ended it (a 200 stream whose last event is a slow_reader error, then the
    connection closed), `cut_unread` when the server had ended it and then dropped the
    connection mid-stream as its last event stayed unread, else `not_cut`,
    `closed_without_error` (a whole stream that ended without one) or the status."""
    request = {"model": model, "prompt": "tell me a story", "max_tokens": max_tokens,
               "ignore_eos": True, "stream": True}  # fmt: skip
    body = json.dumps(request).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF_BYTES)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, (host, port))
        await loop.sock_sendall(sock, head + body)
        sent = time.monotonic()
        await asyncio.sleep(hold_s)
        data = bytearray()
        closed = reset = False
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:  # drains what the server wrote before it cut
            try:
                chunk = await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), 2.0)
            except asyncio.TimeoutError:  # open, and nothing more came: still streaming
                break
            except ConnectionResetError:  # the server gave up on our reading its last event
                closed = reset = True
                break
            if not chunk:
                closed = True
                break
            data += chunk
        took = time.monotonic() - sent
        status = bytes(data[:12]).split(b" ")[1].decode() if data.startswith(b"HTTP/") else "?"
        if status != "200":
            return status, took
        if not closed:
            return "not_cut", took
        if b'"code":"slow_reader"' in data[-4096:]:
            return "cut", took
        if reset or not data.endswith(b"0\r\n\r\n"):  # ended mid-stream: its last event unread
            return "cut_unread", took
        return "closed_without_error", took
    finally:
        sock.close()


async def hostile_worker(
    url: str, model: str, until: float, tally: HostileTally, worker: int, hold_s: float
) -> None:
    """Sends hostile requests, one kind after another, until `until` (time.monotonic())."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    i = worker * 1_000_000
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        while time.monotonic() < until:
            kind = KINDS[i % len(KINDS)]
            i += 1
            try:
                if kind == "non_reader":
                    outcome, took = await non_reader(host, int(port), model, hold_s)
                    if outcome.startswith("cut"):
                        tally.cut_s.append(took)
                elif kind in ("idle", "slowloris"):
                    drip = SLOW_DRIP_S if kind == "slowloris" else None
                    outcome, took = await held_connection(host, int(port), drip)
                    tally.held_s.append(took)
                else:
                    send = {"schema": _schema, "long_prompt": _long_prompt, "bad_json": _bad_json}
                    outcome = await send[kind](client, model, i)
            except (httpx.HTTPError, OSError) as e:
                outcome = f"transport: {type(e).__name__}"
            tally.add(kind, outcome)
