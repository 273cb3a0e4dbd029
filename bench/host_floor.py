"""`bench host-floor`: the shortest device step the host keeps fed, found by sweeping sim steps.

For each batch B and overlap on/off, starts `gapless serve --device sim --sim-profile P
--max-num-seqs B --sim-time-scale S` for each scale S, sends B streaming requests of IN:OUT at
once, and reads the engine's own timeline: the median device time of the steady decode steps
(decode-only steps at the full batch) and the device's idle share over them. The floor of a
(batch, overlap) line is the shortest such step whose idle stayed <= the threshold while every
longer step's did too. Every figure is sim.

    bench host-floor --batches 64,256 --scales 4,2,1,0.5,0.25 --plot-dir figs
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import uvloop

from gapless.bench.serve_args import split_serve_args

DEFAULT_PROFILE = "h100-llama3.2-1b"
DEFAULT_SCALES = (4.0, 2.0, 1.0, 0.7, 0.5, 0.35, 0.25)
IDLE_THRESHOLD = 0.01


@dataclass(frozen=True)
class Point:
    batch: int
    overlap: bool
    scale: float
    step_ms: float | None  # median device ms of steady decode steps (sim)
    idle: float | None  # device idle share over them
    host_ms: float | None  # median schedule + prepare + apply ms per step (all steps)
    tpot_ms: float | None  # median client TPOT
    completed: int
    num_steps: int


def floor_of(points: list[Point], threshold: float = IDLE_THRESHOLD) -> float | None:
    """The shortest step (ms) of one line that kept idle <= threshold, scanning from the
    longest step down and stopping at the first that did not; None if none did."""
    floor = None
    for p in sorted(points, key=lambda p: -(p.step_ms or 0.0)):
        if p.step_ms is None or p.idle is None or p.idle > threshold:
            break
        floor = p.step_ms
    return floor


def _point(batch: int, overlap: bool, scale: float, run: dict[str, Any], steps: list) -> Point:
    host = [sum(s.get(k) or 0.0 for k in ("schedule_ms", "prepare_ms", "apply_ms")) for s in steps]
    return Point(
        batch=batch,
        overlap=overlap,
        scale=scale,
        step_ms=run.get("steady_decode_step_ms"),
        idle=run.get("steady_decode_idle_fraction"),
        host_ms=float(np.median(host)) if host else None,
        tpot_ms=(run.get("tpot_ms") or {}).get("p50"),
        completed=run["completed"],
        num_steps=len(steps),
    )


def sweep(args: argparse.Namespace, serve_args: list[str]) -> list[Point]:
    from gapless.bench.launch import launched_server
    from gapless.bench.loadgen import LoadSpec
    from gapless.bench.prompts import PromptMaker
    from gapless.bench.run import bench_target
    from gapless.bench.targets import Target, served_model
    from gapless.bench.workloads import build_workload
    from gapless.common.model_files import load_tokenizer, resolve_model

    info = resolve_model(args.model)
    maker = PromptMaker(load_tokenizer(info), info.add_bos_token)
    model_args = ["--model", args.model] if args.model else []
    points = []
    total = len(args.batches) * len(args.overlap) * len(args.scales)
    for batch in args.batches:
        workload = build_workload(args.workload, maker, num_requests=batch, seed=args.seed)
        for overlap in args.overlap:
            for scale in args.scales:
                flags = [
                    *model_args,
                    "--device", "sim",
                    "--sim-profile", args.profile,
                    "--max-num-seqs", str(batch),
                    "--sim-time-scale", f"{scale:g}",
                    *([] if overlap else ["--no-overlap"]),
                    *serve_args,
                ]  # fmt: skip
                label = f"[{len(points) + 1}/{total}] batch {batch}, overlap "
                label += f"{'on' if overlap else 'off'}, scale {scale:g}"
                print(f"bench host-floor: {label}", file=sys.stderr, flush=True)
                with launched_server(flags) as url:
                    target = Target("gapless", url, None)
                    load = LoadSpec(
                        ignore_eos=True,
                        eos_token_ids=tuple(info.eos_token_ids),
                        seed=args.seed,
                        progress=not args.no_progress,
                    )
                    model = served_model(target).id
                    run, steps = uvloop.run(bench_target(target, model, workload, load))
                points.append(_point(batch, overlap, scale, run, steps))
                print(format_point(points[-1]), flush=True)
    return points


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def format_point(p: Point) -> str:
    return (
        f"batch {p.batch:4d}  overlap {'on ' if p.overlap else 'off'}  scale {p.scale:5g}  "
        f"step {_ms(p.step_ms)} ms (sim)  idle {_pct(p.idle)}  host {_ms(p.host_ms)} ms/step  "
        f"TPOT p50 {_ms(p.tpot_ms)} ms  ({p.completed} done, {p.num_steps} steps)"
    )


def format_floors(points: list[Point], threshold: float = IDLE_THRESHOLD) -> str:
    lines = [
        f"host floor: shortest steady-decode step (ms, sim) with device idle <= "
        f"{100 * threshold:g} %",
        f"{'batch':>6} {'overlap on':>12} {'overlap off':>12}",
    ]
    for batch in sorted({p.batch for p in points}):
        cells = []
        for overlap in (True, False):
            line = [p for p in points if p.batch == batch and p.overlap == overlap]
            floor = floor_of(line, threshold) if line else None
            if not line:
                cells.append("not run")
            elif floor is None:
                cells.append("none kept")
            else:
                cells.append(f"{floor:.3f}")
        lines.append(f"{batch:>6} {cells[0]:>12} {cells[1]:>12}")
    return "\n".join(lines)


def plot(points: list[Point], plot_dir: Path, threshold: float = IDLE_THRESHOLD) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    steps = [p.step_ms for p in points if p.step_ms]
    lo, hi = (min(steps), max(steps)) if steps else (0.25, 16)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for batch in sorted({p.batch for p in points}):
        for overlap in (True, False):
            line = sorted(
                (p for p in points if p.batch == batch and p.overlap == overlap and p.step_ms),
                key=lambda p: p.step_ms or 0.0,
            )
            if not line:
                continue
            ax.plot(
                [p.step_ms for p in line],
                [100 * (p.idle or 0.0) for p in line],
                marker="o",
                linestyle="-" if overlap else "--",
                label=f"batch {batch}, overlap {'on' if overlap else 'off'}",
            )
    ax.axhline(100 * threshold, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xscale("log")
    # why: a log axis labels its minor ticks as 3x10^-1, 4x10^-1, ..., which run together
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks([t for t in (0.25, 0.5, 1, 2, 4, 8, 16) if lo / 1.5 <= t <= hi * 1.5])
    ax.set_xlabel("steady decode step, ms (sim)")
    ax.set_ylabel("device idle, steady decode (%)")
    ax.set_title("Host floor: device idle vs step time (sim)")
    ax.legend()
    fig.tight_layout()
    plot_dir.mkdir(parents=True, exist_ok=True)
    path = plot_dir / "host_floor.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want numbers joined by ','") from None
    if not values or not all(math.isfinite(v) and 0 < v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: each scale must be in (0, 100]")
    return values


def positive_ints(text: str) -> tuple[int, ...]:
    """An argparse type: integers of at least 1 joined by ','."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want integers joined by ','") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: each must be at least 1")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench host-floor",
        description=__doc__.split("\n\n")[0],
        epilog="Arguments after -- go to every gapless serve it starts.",
    )
    p.add_argument("--profile", default=DEFAULT_PROFILE, help=f"sim profile ({DEFAULT_PROFILE})")
    p.add_argument("--batches", type=positive_ints, default=(64, 256), help="batch sizes (64,256)")
    p.add_argument(
        "--scales",
        type=_floats,
        default=DEFAULT_SCALES,
        help="--sim-time-scale values (" + ",".join(f"{s:g}" for s in DEFAULT_SCALES) + ")",
    )
    p.add_argument(
        "--overlap",
        choices=("both", "on", "off"),
        default="both",
        help="overlap on, off, or both (both)",
    )
    p.add_argument("--workload", default="128:512", help="IN:OUT per request (128:512)")
    p.add_argument("--model", help="the served model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threshold", type=float, default=IDLE_THRESHOLD, help="idle share (0.01)")
    p.add_argument("--output-json", help="write every point here")
    p.add_argument("--plot-dir", help="write host_floor.png here")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str]) -> None:
    from gapless.bench.workloads import parse_fixed

    argv, serve_args = split_serve_args(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if parse_fixed(args.workload) is None:
        parser.error(f"--workload {args.workload!r}: use IN:OUT, e.g. 128:512")
    args.overlap = {"both": (True, False), "on": (True,), "off": (False,)}[args.overlap]
    try:
        points = sweep(args, serve_args)
    except KeyboardInterrupt:
        print("bench host-floor: interrupted", file=sys.stderr)
        sys.exit(130)
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"bench host-floor: {exc}", file=sys.stderr)
        sys.exit(1)
    print(format_floors(points, args.threshold))
    if args.output_json:
        path = Path(args.output_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "profile": args.profile,
            "workload": args.workload,
            "threshold": args.threshold,
            "points": [asdict(p) for p in points],
        }
        path.write_text(json.dumps(doc, indent=1))
        print(f"bench host-floor: wrote {path}", file=sys.stderr)
    if args.plot_dir:
        print(f"bench host-floor: wrote {plot(points, Path(args.plot_dir), args.threshold)}")
