"""PNG figures: the device timeline, per-step host work vs forward, latency CDFs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from gapless.bench.timeline import STAGES, window_of  # noqa: E402

HOST_STAGES = [k for k in STAGES if k != "forward"]
COLORS = {
    "forward": "#4c72b0",
    "schedule": "#dd8452",
    "prepare_inputs": "#55a868",
    "sample": "#c44e52",
    "apply_result": "#8172b3",
}


def run_label(run: dict[str, Any]) -> str:
    device, overlap = run.get("device"), run.get("overlap")
    if device and overlap is not None:
        device += ", overlap " + ("on" if overlap else "off")
    return f"{run['target']}\n{run['workload']}" + (f"\n{device}" if device else "")


def _save(fig: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_timeline(
    steps: list[dict[str, Any]], path: Path, title: str = "", window: int = 40
) -> Path:
    """Device busy spans and idle gaps over a window of steps, with the host-side spans
    (core schedule and apply, runner prepare) of the same steps."""
    steps = window_of(steps, window)
    fig, ax = plt.subplots(figsize=(12, 3.2))
    if not steps:
        ax.text(0.5, 0.5, "no timeline steps", ha="center", va="center", transform=ax.transAxes)
        return _save(fig, path)
    t0 = min(s["plan_sent"] - s.get("schedule_ms", 0.0) / 1000 for s in steps)

    def ms(t: float) -> float:
        return (t - t0) * 1000.0

    rows: dict[str, list[tuple[float, float]]] = {
        "core: schedule": [],
        "runner: prepare": [],
        "device": [],
        "core: apply": [],
    }
    idle: list[tuple[float, float]] = []
    for s in steps:
        rows["core: schedule"].append(
            (ms(s["plan_sent"]) - s.get("schedule_ms", 0.0), s.get("schedule_ms", 0.0))
        )
        rows["runner: prepare"].append(
            (ms(s["plan_received"]), (s["launched"] - s["plan_received"]) * 1000)
        )
        rows["device"].append((ms(s["device_start"]), (s["device_end"] - s["device_start"]) * 1000))
        rows["core: apply"].append(
            (ms(s["result_applied"]) - s.get("apply_ms", 0.0), s.get("apply_ms", 0.0))
        )
        gap = s.get("idle_before_ms") or 0.0
        if gap > 0:
            idle.append((ms(s["device_start"]) - gap, gap))
    colors = ["#dd8452", "#55a868", "#4c72b0", "#8172b3"]
    for y, ((name, spans), color) in enumerate(zip(rows.items(), colors, strict=True)):
        ax.broken_barh(
            spans, (y - 0.35, 0.7), facecolors=color, edgecolors="white", linewidth=0.3, label=name
        )
    ax.broken_barh(
        idle, (2 - 0.35, 0.7), facecolors="#e31a1c", alpha=0.5, label="device idle (work waiting)"
    )
    ax.set_yticks(range(len(rows)), list(rows))
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title or f"device timeline, steps {steps[0]['seq']}-{steps[-1]['seq']}")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), fontsize=7, ncols=5)
    return _save(fig, path)


def plot_breakdown(runs: list[dict[str, Any]], path: Path) -> Path:
    """Median ms per step, forward at the bottom and the host stages stacked on it, one bar per
    run (target and workload)."""
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(runs) + 2), 4.5))
    x = np.arange(len(runs))
    bottom = np.zeros(len(runs))
    for stage in ["forward", *HOST_STAGES]:
        heights = np.array([((r.get("step_breakdown_ms") or {}).get(stage) or 0.0) for r in runs])
        if heights.any():
            ax.bar(x, heights, 0.6, bottom=bottom, color=COLORS[stage], label=stage)
            bottom += heights
    for i, run in enumerate(runs):
        if not any((run.get("step_breakdown_ms") or {}).values()):
            ax.text(i, 0, "no timeline", ha="center", va="bottom", rotation=90, fontsize=8)
        else:
            fwd = run["step_breakdown_ms"].get("forward") or 0.0
            host = bottom[i] - fwd
            share = host / bottom[i] if bottom[i] else 0.0
            ax.text(i, bottom[i], f"host {100 * share:.0f}%", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, [run_label(r) for r in runs], fontsize=8)
    ax.set_ylabel("median ms per step")
    ax.set_title("per-step host work vs forward")
    if bottom.any():
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_cdfs(runs: list[dict[str, Any]], path: Path) -> Path:
    """CDFs of TTFT, ITL and E2E, one line per run; runs need their `samples`."""
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (key, label) in zip(
        axes, (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")), strict=True
    ):
        for run in runs:
            values = np.sort(np.asarray((run.get("samples") or {}).get(key) or [], dtype=float))
            if values.size:
                ax.plot(
                    values,
                    np.arange(1, values.size + 1) / values.size,
                    label=run_label(run).replace("\n", " | "),
                    drawstyle="steps-post",
                )
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.set_title(f"{label} CDF")
        ax.grid(alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=7)
    return _save(fig, path)


def run_title(run: dict[str, Any]) -> str:
    """`target | workload | device` (the device only when the target has an engine timeline)."""
    return run_label(run).replace("\n", " | ")


def plot_tenant_tokens(run: dict[str, Any], path: Path) -> Path:
    """Each tenant's cumulative output tokens received over time, the backlogged window shaded;
    the run needs its `tenants` and `fairness`."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    fairness = run["fairness"]
    if fairness["window_start_s"] is not None:
        ax.axvspan(
            fairness["window_start_s"],
            fairness["window_end_s"],
            color="#bbbbbb",
            alpha=0.35,
            label="all tenants backlogged",
        )
    for t in run["tenants"]:
        series = t["series"]
        label = f"{t['name']} ({t['completed']}/{t['num_requests']} req"
        label += "" if t["weight"] == 1.0 else f", weight {t['weight']:g}"
        label += "" if t["priority"] is None else f", priority {t['priority']}"
        ax.plot(series["t_s"], series["tokens"], drawstyle="steps-post", label=label + ")")
    jain = fairness["jain_index"]
    subtitle = f"Jain's index {jain:.3f}" if jain is not None else fairness["note"]
    ax.set_title(f"{run_title(run)}: tokens received per tenant\n{subtitle}", fontsize=10)
    ax.set_xlabel("s since the run started (client clock)")
    totals = [t["tokens_received"] for t in run["tenants"]]
    if min(totals) * 20 < max(totals):  # why: a one-request tenant is a flat line beside 200
        ax.set_yscale("symlog", linthresh=10)
        ax.set_ylabel("output tokens received (symlog)")
    else:
        ax.set_ylabel("output tokens received")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)
