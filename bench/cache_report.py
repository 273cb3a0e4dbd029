"""`python -m gapless.bench.cache_report FILE... [--plot PNG]`: prefix caching on vs off.

Pairs saved runs of the same device and workload (file names end in `-on.json` / `-off.json`,
as bench/results.sh writes them), prints the markdown table of bench/RESULTS.md and draws TTFT
and throughput side by side.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from gapless.bench.report import device_label


def load_pairs(paths: list[str]) -> dict[tuple[str, str], dict[str, dict[str, Any]]]:
    """(device, workload) -> {"on": run, "off": run}, in the order first seen."""
    pairs: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for p in paths:
        state = Path(p).stem.rsplit("-", 1)[-1]
        if state not in ("on", "off"):
            raise ValueError(f"{p}: the name must end in -on.json or -off.json")
        run = json.loads(Path(p).read_text())
        pairs.setdefault((device_label(run), run["workload"]), {})[state] = run
    return pairs


def _timeline(run: dict[str, Any]) -> dict[str, Any]:
    return run.get("timeline") or {}


def _f(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def table(pairs: dict[tuple[str, str], dict[str, dict[str, Any]]]) -> str:
    head = (
        "| device | workload | caching | requests | TTFT p50 ms | TTFT p90 ms | output tok/s | "
        "prompt tokens cached | prompt tokens computed | core host ms/step |"
    )
    rows = [head, "|" + "---|" * 10]
    for (device, workload), runs in pairs.items():
        for state in ("off", "on"):
            r = runs.get(state)
            if r is None:
                continue
            t = _timeline(r)
            frac = r.get("cached_token_fraction")
            rows.append(
                f"| {device} | `{workload}` | {state} | {r['completed']}/{r['num_requests']} | "
                f"{_f(r['ttft_ms']['p50'])} | {_f(r['ttft_ms']['p90'])} | "
                f"{_f(r['output_token_throughput'])} | "
                f"{'-' if frac is None else f'{100 * frac:.1f} %'} | "
                f"{_f(t.get('num_prefill_tokens'))} | {_f(t.get('core_host_ms_per_step'), 3)} |"
            )
    return "\n".join(rows)


def plot(pairs: dict[tuple[str, str], dict[str, dict[str, Any]]], path: Path) -> Path:
    from gapless.bench.plots import _save, plt

    keys = [k for k, v in pairs.items() if "on" in v and "off" in v]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 2.2 * len(keys)), 4.2))
    labels = [f"{dev.split(',')[0]}\n{wl}" for dev, wl in keys]  # device without "overlap on"
    x = range(len(keys))
    for ax, (title, get) in zip(
        axes,
        (
            ("TTFT p50, off / on (x faster)", lambda r: r["ttft_ms"]["p50"]),
            ("output throughput, on / off (x)", lambda r: r["output_token_throughput"]),
        ),
        strict=True,
    ):
        off = [get(pairs[k]["off"]) for k in keys]
        on = [get(pairs[k]["on"]) for k in keys]
        ratio = [a / b if "TTFT" in title else b / a for a, b in zip(off, on, strict=True)]
        bars = ax.bar(list(x), ratio, color="#4c72b0")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.bar_label(bars, labels=[f"{v:.2f}x" for v in ratio], fontsize=8)
        ax.set_xticks(list(x), labels, fontsize=7, rotation=30, ha="right")
        ax.set_title(title, fontsize=10)
    fig.suptitle("prefix caching on vs off (sim figures are simulated, not a GPU)", fontsize=10)
    return _save(fig, path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m gapless.bench.cache_report", description=__doc__)
    p.add_argument("files", nargs="+")
    p.add_argument("--plot", help="write the figure here")
    args = p.parse_args(argv)
    pairs = load_pairs(args.files)
    print(table(pairs))
    if args.plot:
        print(f"wrote {plot(pairs, Path(args.plot))}")


if __name__ == "__main__":
    main()
