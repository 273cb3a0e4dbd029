"""`python -m gapless.bench.summary FILE...`: the markdown table of bench/RESULTS.md from saved runs."""

from __future__ import annotations

import json
import sys

from gapless.bench.report import device_label

HOST_STAGES = ("schedule", "prepare_inputs", "sample", "apply_result")


def _runs(paths: list[str]) -> list[dict]:
    out = []
    for p in paths:
        data = json.load(open(p))
        out += (
            data["runs"]
            if isinstance(data, dict) and "runs" in data
            else (data if isinstance(data, list) else [data])
        )
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def table(runs: list[dict]) -> str:
    head = (
        "| workload | device | requests | host ms/step | forward ms/step | idle | "
        "idle, steady decode | output tok/s | TTFT p50 ms |"
    )
    rows = [head, "|" + "---|" * 9]
    for r in runs:
        b = r.get("step_breakdown_ms") or {}
        host = [b.get(k) for k in HOST_STAGES]
        host_ms = (
            sum(h for h in host if h is not None) if any(h is not None for h in host) else None
        )
        rows.append(
            f"| {r['workload']} | {device_label(r)} | {r['completed']}/{r['num_requests']} | "
            f"{_ms(host_ms)} | {_ms(b.get('forward'))} | {_pct(r.get('device_idle_fraction'))} | "
            f"{_pct(r.get('steady_decode_idle_fraction'))} | {r['output_token_throughput']:.1f} | "
            f"{_ms(r['ttft_ms']['p50'])} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    print(table(_runs(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    main()
