"""Plain-text tables of runs, and ratios of each target against the first on the same workload."""

from __future__ import annotations

from typing import Any

from gapless.bench.timeline import STAGES

LATENCIES = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))
# (label, path into a run, higher is better)
RATIO_METRICS = (
    ("request throughput", ("request_throughput",), True),
    ("output token throughput", ("output_token_throughput",), True),
    ("TTFT p50", ("ttft_ms", "p50"), False),
    ("TTFT p99", ("ttft_ms", "p99"), False),
    ("TPOT p50", ("tpot_ms", "p50"), False),
    ("ITL p50", ("itl_ms", "p50"), False),
    ("E2E p50", ("e2e_ms", "p50"), False),
)


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _dig(run: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = run
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, (int, float)) else None


def device_label(run: dict[str, Any]) -> str:
    device = run.get("device")
    if device is None:
        return "- (no engine timeline)"
    overlap = run.get("overlap")
    return device if overlap is None else f"{device}, overlap {'on' if overlap else 'off'}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def format_run(run: dict[str, Any]) -> str:
    sim = " (sim)" if str(run.get("device") or "").startswith("sim") else ""
    idle = run.get("device_idle_fraction")
    rows = [
        ("Model", run.get("model", "-")),
        ("Requests completed / failed", f"{run['completed']} / {run['failed']}"),
        ("Duration (s)", _num(run["duration_s"])),
        ("Request throughput (req/s)", _num(run["request_throughput"])),
        ("Output token throughput (tok/s)", _num(run["output_token_throughput"])),
        ("Device", device_label(run)),
        ("Device idle" + sim, "-" if idle is None else f"{100 * idle:.1f} %"),
        ("Device idle, steady decode" + sim, _pct(run.get("steady_decode_idle_fraction"))),
        ("Median step, steady decode (ms)" + sim, _num(run.get("steady_decode_step_ms"), 3)),
        ("Prompt tokens cached (server)", _pct(run.get("cached_token_fraction"))),
    ]
    title = f" {run['target']} | {run['workload']} "
    lines = [f"{title:=^60}"]
    lines += [f"{k:<40}{v:>20}" for k, v in rows]
    lines += _replica_lines(run, sim)
    lines.append(f"{'latency (ms)':<20}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for label, key in LATENCIES:
        d = run[key]
        lines.append(
            f"{label:<20}" + "".join(f"{_num(d[p]):>10}" for p in ("mean", "p50", "p90", "p99"))
        )
    # why STAGES and not the run's keys: saved runs may hold stages the timeline no longer has
    breakdown = {k: (run.get("step_breakdown_ms") or {}).get(k) for k in STAGES}
    if any(v is not None for v in breakdown.values()):
        lines.append(f"{'median per step (ms)' + sim:<40}{'':>20}")
        lines += [f"  {k:<38}{_num(v, 3):>20}" for k, v in breakdown.items()]
    for error, count in (run.get("errors") or {}).items():
        lines.append(f"  failed x{count}: {error[:100]}")
    return "\n".join(lines)


def _replica_lines(run: dict[str, Any], sim: str) -> list[str]:
    """Each engine replica's idle and tokens, each rank's device time and where requests
    were routed, when the server has more than one of them."""
    lines = []
    for r in run.get("replicas") or []:
        label = f"Replica {r['replica']}: device idle{sim}"
        lines.append(f"{label:<40}{_pct(r['device_idle_fraction']):>20}")
        tokens = f"{r['num_tokens']} / {r['num_cached_tokens']}"
        lines.append(f"{'  tokens computed / taken from cache':<40}{tokens:>20}")
    ranks = run.get("rank_device_busy_s") or {}
    if len(ranks) > 1:
        lines.append(f"{'device busy per replica/rank (s)' + sim:<40}{'':>20}")
        lines += [f"  {k:<38}{_num(v, 2):>20}" for k, v in ranks.items()]
    routed = run.get("routed_requests") or {}
    if routed:
        lines.append(f"{'requests routed (replica/reason)':<40}{'':>20}")
        lines += [f"  {k:<38}{v:>20}" for k, v in routed.items()]
    return lines


def ratios(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload, each later target's metric divided by the first target's."""
    out = []
    by_workload: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_workload.setdefault(run["workload"], []).append(run)
    for workload, group in by_workload.items():
        base = group[0]
        for run in group[1:]:
            values = {}
            for label, path, _ in RATIO_METRICS:
                a, b = _dig(run, path), _dig(base, path)
                values[label] = a / b if a is not None and b else None
            out.append(
                {
                    "workload": workload,
                    "target": run["target"],
                    "baseline": base["target"],
                    **values,
                }
            )
    return out


def format_ratios(table: list[dict[str, Any]]) -> str:
    if not table:
        return ""
    lines = [f"{' ratio to the first target ':=^60}"]
    for row in table:
        lines.append(f"{row['target']} / {row['baseline']} on {row['workload']}")
        for label, _, higher_better in RATIO_METRICS:
            hint = "higher is better" if higher_better else "lower is better"
            value = "-" if row[label] is None else f"{row[label]:.3f}x"
            lines.append(f"  {label:<30}{value:>12}   ({hint})")
    return "\n".join(lines)


def _fairness_line(run: dict[str, Any]) -> str:
    f = run["fairness"]
    if f["jain_index"] is None:
        return f"Jain's fairness index: - ({f['note']})"
    window = f"{f['window_start_s']:.3f}-{f['window_end_s']:.3f} s"
    return f"Jain's fairness index (tokens / weight, backlogged {window}): {f['jain_index']:.3f}"


def _tenant_cells(t: dict[str, Any]) -> str:
    ttft = t["ttft_ms"]
    return (
        f"{_num(ttft['p50']):>10}{_num(ttft['p99']):>10}{_num(t['output_token_throughput'], 1):>10}"
        f"{_num(t['tokens_received'], 0):>9}{_num(t['window_tokens'], 0):>9}"
        f"{_pct(t['window_share']):>8}{_pct(t['weight_share']):>8}"
    )


TENANT_HEAD = (
    f"{'TTFT p50':>10}{'TTFT p99':>10}{'tok/s':>10}{'tokens':>9}{'window':>9}{'share':>8}"
    f"{'weight':>8}"
)


def format_tenants(run: dict[str, Any]) -> str:
    """Per-tenant rows of a multi-tenant run: requests, TTFT (ms), output tok/s over the
    tenant's span, tokens received, tokens and share in the backlogged window, weight share."""
    lines = [f"{'tenant':<12}{'priority':>12}{'done/sent':>10}" + TENANT_HEAD]
    for t in run["tenants"]:
        prio = "-" if t["priority"] is None else str(t["priority"])
        done = f"{t['completed']}/{t['num_requests']}"
        lines.append(f"{t['name'][:12]:<12}{prio[:12]:>12}{done:>10}" + _tenant_cells(t))
    return "\n".join([*lines, _fairness_line(run)])


def format_tenants_by_target(runs: list[dict[str, Any]]) -> str:
    """The tenants of every multi-tenant run side by side, one row per target and tenant."""
    runs = [r for r in runs if r.get("tenants")]
    if len(runs) < 2:
        return ""
    lines = [f"{' tenants by target ':=^90}", f"{'target':<14}{'tenant':<10}" + TENANT_HEAD]
    for run in runs:
        for t in run["tenants"]:
            lines.append(f"{run['target'][:14]:<14}{t['name'][:10]:<10}" + _tenant_cells(t))
        lines.append(f"{run['target'][:14]:<14}{_fairness_line(run)}")
    return "\n".join(lines)
