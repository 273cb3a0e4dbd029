"""The engine's device timeline (`GET /v1/engine/timeline`): idle fraction and per-step medians
over the steps of one run. A target without the endpoint gives None everywhere."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np

# step_breakdown_ms key -> the step field holding it (ms)
STAGES = {
    "schedule": "schedule_ms",
    "prepare_inputs": "prepare_ms",
    "forward": "forward_ms",
    "sample": "sample_ms",
    "apply_result": "apply_ms",
}
MAX_STEPS = 8192  # `last` asked for after a run (gapless keeps this many)
FALLBACK_STEPS = 256  # asked for when a server refuses MAX_STEPS


async def fetch_timeline(
    base_url: str, api_key: str | None, last: int, timeout_s: float = 30.0, replica: int = 0
) -> dict[str, Any] | None:
    """The timeline's JSON (of one engine replica), or None when the target has none (404,
    not JSON, unreachable)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    params = {"last": last} | ({"replica": replica} if replica else {})
    try:
        async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout_s) as c:
            resp = await c.get("/v1/engine/timeline", params=params)
            if resp.status_code == 400 and last > FALLBACK_STEPS:
                params["last"] = FALLBACK_STEPS
                resp = await c.get("/v1/engine/timeline", params=params)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    try:
        data = resp.json()
    except ValueError:
        return None
    return data if isinstance(data, dict) and isinstance(data.get("steps"), list) else None


def last_seq(timeline: dict[str, Any] | None) -> int:
    """The newest step's sequence number, -1 when there is none."""
    if not timeline or not timeline["steps"]:
        return -1
    return max(int(s["seq"]) for s in timeline["steps"])


def run_steps(after: dict[str, Any] | None, before_seq: int) -> list[dict[str, Any]]:
    """The steps that ran after `before_seq`, in order."""
    if after is None:
        return []
    return sorted((s for s in after["steps"] if int(s["seq"]) > before_seq), key=lambda s: s["seq"])


def idle_fraction(steps: list[dict[str, Any]]) -> tuple[float | None, float, float]:
    """(idle / (busy + idle), busy s, idle s) over the steps; idle only while work waited."""
    steps = [s for s in steps if s.get("num_tokens", 1)]  # empty steps count neither way
    if not steps:
        return None, 0.0, 0.0
    busy = sum(max(0.0, s["device_end"] - s["device_start"]) for s in steps)
    idle = sum(max(0.0, s.get("idle_before_ms") or 0.0) for s in steps) / 1000.0
    total = busy + idle
    return (idle / total if total > 0 else None), busy, idle


def steady_decode(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Decode-only steps at the run's largest batch: the steady state of an all-at-once load."""
    dec = [s for s in steps if s.get("num_tokens") and not s.get("num_prefill_tokens")]
    if not dec:
        return []
    full = max(s["num_seqs"] for s in dec)
    return [s for s in dec if s["num_seqs"] == full]


def step_breakdown(steps: list[dict[str, Any]]) -> dict[str, float | None]:
    """Median ms per step of each stage; None for a stage no step reports."""
    out: dict[str, float | None] = {}
    for key, fld in STAGES.items():
        values = [s[fld] for s in steps if s.get(fld) is not None]
        out[key] = float(np.median(values)) if values else None
    return out


def num_replicas(timeline: dict[str, Any] | None) -> int:
    """Engine replicas the server runs (--data-parallel-size), 1 when it does not say."""
    n = (timeline or {}).get("num_replicas", 1)
    return n if isinstance(n, int) and n >= 1 else 1


def replicas_summary(
    before: list[dict[str, Any] | None], after: list[dict[str, Any] | None]
) -> dict[str, Any]:
    """The timeline keys over every replica's steps (the idle fraction is their summed idle
    over their summed busy + idle), with `replicas`: each one's own idle and tokens."""
    per = [run_steps(a, last_seq(b)) for b, a in zip(before, after, strict=True)]
    out = timeline_summary(before[0], after[0])
    if len(per) == 1 or out["timeline"] is None:
        return out
    every = [s for steps in per for s in steps]
    fraction, busy, idle = idle_fraction(every)
    steady = steady_decode(every)
    out.update(
        device_idle_fraction=fraction,
        steady_decode_idle_fraction=idle_fraction(steady)[0],
        steady_decode_step_ms=step_breakdown(steady)["forward"],
        step_breakdown_ms=step_breakdown(every),
    )
    out["timeline"].update(
        num_steps=len(every),
        busy_s=busy,
        idle_s=idle,
        num_tokens=sum(int(s.get("num_tokens", 0)) for s in every),
        num_prefill_tokens=sum(int(s.get("num_prefill_tokens", 0)) for s in every),
        num_cached_tokens=sum(int(s.get("num_cached_tokens", 0)) for s in every),
    )
    out["replicas"] = []
    for k, steps in enumerate(per):
        fraction, busy, _ = idle_fraction(steps)
        out["replicas"].append(
            {
                "replica": k,
                "device_idle_fraction": fraction,
                "busy_s": busy,
                "num_steps": len(steps),
                "num_tokens": sum(int(s.get("num_tokens", 0)) for s in steps),
                "num_cached_tokens": sum(int(s.get("num_cached_tokens", 0)) for s in steps),
            }
        )
    return out


def timeline_summary(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any]:
    """The timeline keys of the bench's JSON (all None for a target without a timeline)."""
    if after is None:
        return {
            "device": None,
            "overlap": None,
            "device_idle_fraction": None,
            "steady_decode_idle_fraction": None,
            "steady_decode_step_ms": None,
            "step_breakdown_ms": dict.fromkeys(STAGES),
            "timeline": None,
        }
    before_seq = last_seq(before)
    steps = run_steps(after, before_seq)
    fraction, busy, idle = idle_fraction(steps)
    steady = steady_decode(steps)
    first = steps[0]["seq"] if steps else None
    return {
        "device": after.get("device"),
        "overlap": after.get("overlap"),
        "device_idle_fraction": fraction,
        "steady_decode_idle_fraction": idle_fraction(steady)[0],
        # the step a client's TPOT is set by: the median forward of the full batch's decode
        "steady_decode_step_ms": step_breakdown(steady)["forward"],
        "step_breakdown_ms": step_breakdown(steps),
        "timeline": {
            "num_steps": len(steps),
            "busy_s": busy,
            "idle_s": idle,
            # False when the engine's ring had already dropped early steps of the run
            "complete": first is not None and (before_seq < 0 or first == before_seq + 1),
            # tokens the device computed, prompt tokens taken from the prefix cache instead,
            # and the core's mean host time per step (schedule + apply result), ms
            "num_tokens": sum(int(s.get("num_tokens", 0)) for s in steps),
            "num_prefill_tokens": sum(int(s.get("num_prefill_tokens", 0)) for s in steps),
            "num_cached_tokens": sum(int(s.get("num_cached_tokens", 0)) for s in steps),
            "core_host_ms_per_step": _mean_host_ms(steps),
        },
    }


def _mean_host_ms(steps: list[dict[str, Any]]) -> float | None:
    host = [s["schedule_ms"] + s["apply_ms"] for s in steps if s.get("num_tokens")]
    return float(np.mean(host)) if host else None


def window_of(steps: list[dict[str, Any]], size: int) -> list[dict[str, Any]]:
    """`size` consecutive steps from the middle of the run (its steady state)."""
    if len(steps) <= size:
        return steps
    start = (len(steps) - size) // 2
    return steps[start : start + size]
