"""Which figures a bench run (or a set of saved results) turns into, and their file names."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from gapless.bench.plots import plot_breakdown, plot_cdfs, plot_tenant_tokens, plot_timeline


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "run"


def load_runs(paths: list[Path]) -> list[dict[str, Any]]:
    """Runs of saved --output-json files: a run object, {"runs": [...]}, or a list of runs."""
    runs: list[dict[str, Any]] = []
    for path in paths:
        doc = json.loads(path.read_text())
        if isinstance(doc, dict) and "runs" in doc:
            runs += doc["runs"]
        elif isinstance(doc, list):
            runs += doc
        else:
            runs.append(doc)
    return runs


def plot_runs(
    runs: list[dict[str, Any]], steps: list[list[dict[str, Any]]], out_dir: Path
) -> list[Path]:
    """timeline_<target>_<workload>.png per run with a timeline, tenants_<target>_<workload>.png
    per multi-tenant run, breakdown.png, latency_cdf.png."""
    written = []
    for run, run_steps in zip(runs, steps, strict=True):
        tag = f"{slug(run['target'])}_{slug(run['workload'])}"
        if run_steps:
            title = f"{run['target']} | {run['workload']} | {run.get('device')}: device timeline"
            written.append(plot_timeline(run_steps, out_dir / f"timeline_{tag}.png", title))
        if run.get("tenants"):
            written.append(plot_tenant_tokens(run, out_dir / f"tenants_{tag}.png"))
    written.append(plot_breakdown(runs, out_dir / "breakdown.png"))
    written.append(plot_cdfs(runs, out_dir / "latency_cdf.png"))
    return written


def plot_saved(paths: list[Path], out_dir: Path) -> list[Path]:
    """The same figures from saved results; timelines from each run's kept window of steps."""
    runs = load_runs(paths)
    steps = [((r.get("timeline") or {}).get("window_steps") or []) for r in runs]
    return plot_runs(runs, steps, out_dir)
