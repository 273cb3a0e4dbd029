"""Sends a workload to one target: all at once, at a Poisson rate, or under a concurrency cap."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import aiohttp
import numpy as np
from tqdm import tqdm

from gapless.bench.client import RequestRecord, completion_payload, stream_completion
from gapless.bench.workloads import Workload


@dataclass(frozen=True)
class LoadSpec:
    request_rate: float = math.inf  # requests/s; inf sends everything at once
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = True
    eos_token_ids: tuple[int, ...] = ()  # banned by logit bias too when ignoring EOS
    temperature: float = 0.0
    request_timeout_s: float = 600.0
    progress: bool = True


@dataclass
class LoadResult:
    records: list[RequestRecord]
    duration_s: float  # first send to last response
    t0: float = 0.0  # time.perf_counter() at the start, when offset 0 is sent


def arrival_offsets(n: int, rate: float, seed: int) -> np.ndarray:
    """[n] seconds after the start at which each request is sent; the same for every target."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return np.cumsum(gaps) - gaps[0]


def request_offsets(workload: Workload, spec: LoadSpec) -> np.ndarray:
    """[n] send times in s: the workload's own (a multi-tenant run), else the spec's rate."""
    arrivals = [r.arrival_s for r in workload.requests]
    if arrivals and all(a is not None for a in arrivals):
        return np.asarray(arrivals, dtype=float)
    return arrival_offsets(len(arrivals), spec.request_rate, spec.seed)


# why: servers close a connection idle for 5 s (uvicorn's and llama-server's default) and
# aiohttp reused one for up to 15 s, so a request sent as the server closed it failed unsent:
# a tenant back after 11 s away lost 6-26 of 1300 requests ("Can not write request body",
# "Server disconnected") with 15 s, none with this
KEEPALIVE_S = 3.0


def http_client(api_key: str | None, timeout_s: float, size: int) -> aiohttp.ClientSession:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return aiohttp.ClientSession(
        headers=headers,
        timeout=aiohttp.ClientTimeout(total=timeout_s, connect=30.0),
        connector=aiohttp.TCPConnector(limit=max(1, size), keepalive_timeout=KEEPALIVE_S),
    )


async def run_load(
    base_url: str,
    api_key: str | None,
    model: str,
    workload: Workload,
    spec: LoadSpec,
    label: str = "",
) -> LoadResult:
    if any(r.session is not None for r in workload.requests):
        return await run_sessions(base_url, api_key, model, workload, spec, label)
    requests = workload.requests
    offsets = request_offsets(workload, spec)
    gate = asyncio.Semaphore(spec.max_concurrency or len(requests) or 1)
    bar = tqdm(total=len(requests), desc=label or base_url, unit="req", disable=not spec.progress)
    size = min(len(requests), spec.max_concurrency or len(requests))
    url = base_url.rstrip("/") + "/v1/completions"
    async with http_client(api_key, spec.request_timeout_s, size) as client:
        t0 = time.perf_counter()

        async def one(i: int) -> RequestRecord:
            # uvloop's timers round to the millisecond: sleep again if one woke early
            while (delay := t0 + offsets[i] - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            req = requests[i]
            body = completion_payload(
                model,
                req.prompt,
                req.output_len,
                ignore_eos=spec.ignore_eos,
                temperature=spec.temperature,
                eos_token_ids=spec.eos_token_ids,
                user=req.tenant,
                priority=req.priority,
            )
            headers = {"X-Tenant": req.tenant} if req.tenant is not None else None
            async with gate:
                record = RequestRecord(req.prompt_len, req.output_len, tenant=req.tenant)
                await stream_completion(client, url, body, record, headers)
            bar.update(1)
            return record

        tasks = [asyncio.create_task(one(i)) for i in range(len(requests))]
        try:
            records = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            bar.close()
        duration = time.perf_counter() - t0
    return LoadResult(list(records), duration, t0)


async def run_sessions(
    base_url: str,
    api_key: str | None,
    model: str,
    workload: Workload,
    spec: LoadSpec,
    label: str = "",
) -> LoadResult:
    """Multi-turn chat: each session sends its turns one after another, each turn's prompt the
    session's earlier prompts and answers (text, as a client resends its history), then the
    turn's message; the next turn goes `workload.think_s` after the answer ended. Sessions
    start at the spec's rate (all at once by default) and run side by side, capped by
    max_concurrency sessions."""
    turns: dict[int, list] = {}
    for req in workload.requests:
        assert req.session is not None, "a chat workload has only session turns"
        turns.setdefault(req.session, []).append(req)
    offsets = arrival_offsets(len(turns), spec.request_rate, spec.seed)
    gate = asyncio.Semaphore(spec.max_concurrency or len(turns) or 1)
    total = len(workload.requests)
    bar = tqdm(total=total, desc=label or base_url, unit="req", disable=not spec.progress)
    size = min(len(turns), spec.max_concurrency or len(turns))
    records: list[RequestRecord] = []
    url = base_url.rstrip("/") + "/v1/completions"
    async with http_client(api_key, spec.request_timeout_s, size) as client:
        t0 = time.perf_counter()

        async def session(k: int, reqs: list) -> None:
            while (delay := t0 + offsets[k] - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            history = ""
            async with gate:
                for turn, req in enumerate(reqs):
                    if turn and workload.think_s:
                        await asyncio.sleep(workload.think_s)
                    prompt = f"{history} {req.prompt}" if history else req.prompt
                    body = completion_payload(
                        model,
                        prompt,
                        req.output_len,
                        ignore_eos=spec.ignore_eos,
                        temperature=spec.temperature,
                        eos_token_ids=spec.eos_token_ids,
                    )
                    record = RequestRecord(0, req.output_len, text=[])  # length from usage
                    records.append(record)
                    await stream_completion(client, url, body, record)
                    bar.update(1)
                    if not record.ok:
                        return  # a session whose turn failed cannot go on
                    history = prompt + "".join(record.text or [])
                    record.text = None

        tasks = [asyncio.create_task(session(k, reqs)) for k, reqs in enumerate(turns.values())]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            bar.close()
        duration = time.perf_counter() - t0
    missing = total - len(records)  # turns never sent after a failed one
    records += [RequestRecord(0, 0, error="an earlier turn of its session failed")] * missing
    return LoadResult(records, duration, t0)
