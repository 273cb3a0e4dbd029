"""The GPU check's report: one JSON document (report.json) and its markdown (report.md),
rewritten after every stage, so a run cut short still leaves what it measured.

Every figure names the card it was measured on. The issue's acceptance checks are computed
here from the measurements (never typed in): decode steps against their HBM floors, the mixed
step's share of the measured matmul peak, idle and throughput with overlap on and off, and the
first request's TTFT on a server started with a cold kernel cache.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

FILES = ("report.json", "report.md")
TOP_KERNELS = 10
# the issue's acceptance checks: (what, shape, measure, comparison, target)
CHECKS = (
    ("8B steady decode: step / HBM floor", "llama3-8b", "decode_hbm_ratio", "<=", 1.35),
    ("1B steady decode: step / HBM floor", "llama3.2-1b", "decode_hbm_ratio", "<=", 1.8),
    ("8B mixed step: share of the measured bf16 peak", "llama3-8b", "mixed_peak_share", ">=", 0.6),
    ("8B overlap on: device idle", "llama3-8b", "idle_on", "<=", 0.02),
    ("1B overlap on: device idle", "llama3.2-1b", "idle_on", "<=", 0.02),
    ("8B output tok/s, overlap on / off", "llama3-8b", "overlap_gain", ">=", 1.0),
    ("1B output tok/s, overlap on / off", "llama3.2-1b", "overlap_gain", ">=", 1.0),
    ("cold kernel cache: first TTFT / warm median TTFT", "llama3-8b", "cold_ttft_ratio", "<=", 2.0),
)


class Report:
    """The report's data (a JSON-ready dict), written whole to out_dir on every save()."""

    def __init__(self, out_dir: Path, data: dict | None = None) -> None:
        self.out = out_dir
        self.out.mkdir(parents=True, exist_ok=True)
        self.data: dict[str, Any] = data or {}
        self.data.setdefault("status", "running")
        for key in ("stages", "servers", "profiles", "notes"):
            self.data.setdefault(key, [])

    def save(self) -> None:
        self.data["checks"] = checks(self.data)
        self.data["sim_profiles"] = sim_profiles(self.data)
        _write(self.out / "report.json", json.dumps(self.data, indent=1, default=str))
        _write(self.out / "report.md", render(self.data))


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # why: a run killed mid-write still leaves the last whole file


# ------------------------------------------------------------------------------- measures


def _server(data: dict, shape: str, overlap: bool) -> dict | None:
    for s in data["servers"]:
        if s["shape"] == shape and s["overlap"] == overlap and s.get("bench"):
            return s
    return None


def _profile(data: dict, shape: str) -> dict | None:
    for p in data["profiles"]:
        if p.get("shape") == shape and "decode" in p:
            return p
    return None


def measure(data: dict, shape: str, what: str) -> float | None:
    """One of the CHECKS' measures, None where the run did not reach it."""
    profile = _profile(data, shape)
    on, off = _server(data, shape, True), _server(data, shape, False)
    if what == "decode_hbm_ratio":
        return profile["decode"]["hbm_ratio"] if profile else None
    if what == "mixed_peak_share":
        return profile["mixed"]["peak_share"] if profile and "mixed" in profile else None
    if what == "idle_on":
        return on["bench"].get("device_idle_fraction") if on else None
    if what == "overlap_gain":
        if not (on and off):
            return None
        a, b = on["bench"]["output_token_throughput"], off["bench"]["output_token_throughput"]
        return a / b if a and b else None
    if what == "cold_ttft_ratio":
        s = next((s for s in data["servers"] if s["shape"] == shape and s.get("cold")), None)
        if not s or s.get("first_ttft_ms") is None or not s.get("warm_ttft_ms"):
            return None
        return s["first_ttft_ms"] / statistics.median(s["warm_ttft_ms"])
    raise ValueError(f"unknown measure {what!r}")


def checks(data: dict) -> list[dict]:
    out = []
    for what, shape, name, op, target in CHECKS:
        value = measure(data, shape, name)
        ok = None if value is None else (value <= target if op == "<=" else value >= target)
        out.append({"check": what, "value": value, "target": f"{op} {target:g}", "pass": ok})
    return out


def sim_profiles(data: dict) -> list[dict]:
    """For each profiled dense Llama-family shape: the sim profile of this card (datasheet
    figures, the published efficiencies) with decode_scale and prefill_scale measured: the
    runner's forward time over the profile's modelled step at the same step."""
    from gapless.bench.gpu_check.floors import card, model_params
    from gapless.bench.gpu_check.shapes import SHAPES
    from gapless.gpu_runner.sim.profiles import SimProfile, profile_fields, step_time

    info = data.get("card")
    if not info:
        return []
    sheet = card(info["name"])
    out = []
    for p in data["profiles"]:
        shape = SHAPES.get(p.get("shape", ""))
        if shape is None or "decode" not in p or shape.family not in ("llama", "mistral"):
            continue
        arch = shape.arch()
        if arch.num_experts or arch.sliding_window:
            continue  # the sim models neither experts nor windows
        params = model_params(arch)
        base = SimProfile(
            name=f"{_slug(info['name'])}-{shape.name}-gapless",
            description=f"{info['name']}, {shape.source} shapes, bf16: gapless's runner as the "
            "GPU check measured it",
            peak_flops=sheet.bf16_peak or info["bf16_peak_measured"],
            hbm_bandwidth=sheet.hbm_bandwidth or info["read_bandwidth_measured"],
            memory_bytes=info["memory_bytes"],
            memory_utilization=0.9,
            mfu=0.6,
            bandwidth_efficiency=0.85,
            num_params=params,
            num_layers=arch.num_layers,
            hidden_size=arch.hidden_size,
            num_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            weight_bytes=2 * params,
            kv_dtype_bytes=2,
        )
        d = p["decode"]
        modelled_decode = step_time(base, d["batch"], d["batch"], d["batch"] * d["context"])
        fields = profile_fields(base)
        fields["decode_scale"] = d["forward_ms"] / 1e3 / modelled_decode
        m = p.get("mixed")
        if m:
            seqs = m["prompts"] + m["decodes"]
            context = m["prompts"] * m["prompt_len"] + m["decodes"] * d["context"]
            modelled = step_time(base, m["tokens"], seqs, context, m["prompts"] * m["prompt_len"])
            fields["prefill_scale"] = m["forward_ms"] / 1e3 / modelled
        out.append(fields)
    return out


def _slug(card_name: str) -> str:
    words = card_name.replace("NVIDIA", "").split()
    return (words[0] if words else "gpu").lower()


# -------------------------------------------------------------------------------- markdown


def _f(value, fmt: str = "{:.2f}", none: str = "—") -> str:
    return none if value is None else fmt.format(value)


def _pct(value) -> str:
    return _f(None if value is None else 100 * value, "{:.1f} %")


def render(data: dict) -> str:
    card = data.get("card") or {}
    name = card.get("name", "(card not measured yet)")
    lines = [
        f"# gapless GPU check on {name}",
        "",
        f"Status: **{data['status']}** after {_f(data.get('elapsed_s'), '{:.0f}')} s of a "
        f"{_f(data.get('budget_s'), '{:.0f}')} s budget. Every figure below was measured on "
        f"{name} in this run unless it says `sim`.",
        "",
    ]
    lines += _card(card)
    lines += _checks(data)
    lines += _servers(data, name)
    lines += _profiles(data, name)
    lines += _kernels(data)
    lines += _pytest(data)
    lines += _sim(data, name)
    lines += _stages(data)
    if data["notes"]:
        lines += ["## Notes", ""] + [f"- {n}" for n in data["notes"]] + [""]
    return "\n".join(lines)


def _card(card: dict) -> list[str]:
    if not card:
        return []
    sheet = card.get("datasheet", {})
    return [
        "## The card",
        "",
        "| | |",
        "|---|---|",
        f"| name | {card['name']} (compute capability {card.get('capability')}, "
        f"{card.get('multiprocessors')} SMs) |",
        f"| memory | {card['memory_bytes'] / 2**30:.1f} GiB |",
        f"| bf16 matmul, measured | {card['bf16_peak_measured'] / 1e12:.0f} TFLOP/s "
        f"(datasheet {_f(sheet.get('bf16_peak') and sheet['bf16_peak'] / 1e12, '{:.0f}')}) |",
        f"| HBM read, measured | {card['read_bandwidth_measured'] / 1e12:.2f} TB/s (datasheet "
        f"{_f(sheet.get('hbm_bandwidth') and sheet['hbm_bandwidth'] / 1e12)}; copy "
        f"{card['copy_bandwidth_measured'] / 1e12:.2f} TB/s read + written) |",
        f"| floors use | {data_floor_basis(card)} |",
        f"| software | torch {card.get('torch')}, CUDA {card.get('cuda')}, flashinfer "
        f"{card.get('flashinfer')} |",
        "",
    ]


def data_floor_basis(card: dict) -> str:
    sheet = card.get("datasheet", {})
    bw = "the datasheet's bandwidth" if sheet.get("hbm_bandwidth") else "the measured read"
    return f"{bw} for HBM floors, the measured matmul peak for FLOP floors"


def _checks(data: dict) -> list[str]:
    lines = ["## The issue's checks", "", "| check | measured | target | |", "|---|---|---|---|"]
    for c in data.get("checks") or checks(data):
        mark = {True: "pass", False: "**fail**", None: "not reached"}[c["pass"]]
        lines.append(f"| {c['check']} | {_f(c['value'], '{:.3f}')} | {c['target']} | {mark} |")
    return lines + [""]


def _servers(data: dict, name: str) -> list[str]:
    if not data["servers"]:
        return []
    lines = [
        f"## Served through `gapless bench` ({name})",
        "",
        "| shape | workload (issue's) | overlap | out tok/s | idle | idle, steady | steady step "
        "| HBM floor (est.) | ratio | TTFT p50 | first TTFT | startup |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in data["servers"]:
        b = s.get("bench") or {}
        floor = s.get("floor") or {}
        step = b.get("steady_decode_step_ms")
        ratio = step / floor["hbm_floor_ms"] if step and floor.get("hbm_floor_ms") else None
        ttft = (b.get("ttft_ms") or {}).get("p50")
        first = s.get("first_ttft_ms")
        error = f" ({s['error']})" if s.get("error") else ""
        lines.append(
            f"| {s['shape']} | {s['workload']} ({s.get('issue_workload', '—')}) | "
            f"{'on' if s['overlap'] else 'off'} | {_f(b.get('output_token_throughput'), '{:,.0f}')}"
            f" | {_pct(b.get('device_idle_fraction'))} | "
            f"{_pct(b.get('steady_decode_idle_fraction'))} | {_f(step, '{:.2f} ms')} | "
            f"{_f(floor.get('hbm_floor_ms'), '{:.2f} ms')} | {_f(ratio)} | "
            f"{_f(ttft and ttft / 1e3, '{:.2f} s')} | {_f(first and first / 1e3, '{:.2f} s')} | "
            f"{_f(s.get('startup_s'), '{:.0f} s')}{error} |"
        )
    lines += [
        "",
        "Steady step: the median forward of the decode steps at the run's largest batch "
        "(bench's `steady_decode_step_ms`); its floor is estimated at the batch's mean context "
        "(prompt + half the output). First TTFT: the first request after `/health` said 200; "
        "a `cold` server started with an empty flashinfer cache.",
        "",
    ]
    for s in data["servers"]:
        if s.get("startup_lines"):
            lines.append(f"Startup of {s['shape']}, overlap {'on' if s['overlap'] else 'off'}:")
            lines += ["", "```", *s["startup_lines"], "```", ""]
    return lines


def _profiles(data: dict, name: str) -> list[str]:
    rows = [p for p in data["profiles"] if "decode" in p]
    failed = [p for p in data["profiles"] if "decode" not in p]
    if not rows and not failed:
        return []
    lines = [
        f"## Steps against their floors ({name}, in process)",
        "",
        "| shape | step | entries | forward | whole step | HBM floor | FLOP floor | "
        "forward / floor | / HBM floor | TFLOP/s | of peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in rows:
        for kind in ("decode", "mixed"):
            r = p.get(kind)
            if not r:
                continue
            entries = (
                f"{r['batch']} × ctx {r['context']}"
                if kind == "decode"
                else f"{r['prompts']} × {r['prompt_len']} prompt + {r['decodes']} decodes"
            )
            lines.append(
                f"| {p['shape']} | {kind} | {entries} | {r['forward_ms']:.2f} ms | "
                f"{r['step_ms']:.2f} ms | {r['hbm_floor_ms']:.2f} ms | {r['flop_floor_ms']:.2f} "
                f"ms | {r['ratio']:.2f} ({r['bound']}) | {r['hbm_ratio']:.2f} | "
                f"{r['tflops']:.0f} | {_pct(r['peak_share'])} |"
            )
    for p in failed:
        lines.append(
            f"| {p.get('shape')} | {p.get('error') or p.get('skipped')} | | | | | | | | | |"
        )
    lines += [
        "",
        "Forward: the model (CUDA events), the number the floors judge; whole step: with "
        "sampling. HBM floor: weights read once (routed experts as expected under uniform "
        "routing), each entry's K/V read once, new K/V written; FLOP floor: matmuls and "
        "attention over the measured bf16 peak.",
        "",
    ]
    return lines


def _kernels(data: dict) -> list[str]:
    lines = []
    for p in data["profiles"]:
        for kind in ("decode", "mixed"):
            r = p.get(kind)
            if not r or not r.get("kernels"):
                continue
            eager = (
                " (run eagerly: the profiler saw no kernels in the graph)"
                if r.get("kernels_eager")
                else ""
            )
            cats = ", ".join(f"{k} {100 * v:.0f} %" for k, v in r["categories"].items())
            busy = ""
            if r.get("kernel_ms") is not None:
                busy = (
                    f" Kernels ran {r['kernel_ms']:.2f} ms of the {r['step_ms']:.2f} ms step "
                    f"({_pct(r['kernel_ms'] / r['step_ms'])}); the rest is the device waiting "
                    "between launches."
                )
            lines += [
                f"### Kernels of {p['shape']}'s {kind} step{eager}",
                "",
                f"Device time by kind: {cats}.{busy}",
                "",
                "| kernel | kind | calls | µs / step | share |",
                "|---|---|---|---|---|",
            ]
            for k in r["kernels"][:TOP_KERNELS]:
                lines.append(
                    f"| `{k['name'][:90]}` | {k['category']} | {k['calls_per_step']:.0f} | "
                    f"{k['us_per_step']:.0f} | {100 * k['share']:.1f} % |"
                )
            lines.append("")
    return (["## Where the time goes", "", CANDIDATES, ""] + lines) if lines else []


CANDIDATES = (
    "What each kind decides among the issue's candidates: `norm` and `elementwise` (RMSNorm's "
    "pow, mean, rsqrt, multiply, and the residual adds): fused residual + RMSNorm; `kv write / "
    "rope` (the cat, neg and index_copy kernels): RoPE fused with the K/V cache write; "
    "`activation`: fused SiLU·mul; `attention`: the attention kernel per group size; `copy / "
    "cast` and `sampling` (the float32 logits, softmax, sort, top-k): logits only for the rows "
    "that sample, sampling on bf16; the device waiting between launches in a mixed step: CUDA "
    "graphs (whole or piecewise) or torch.compile for mixed steps; `matmul` and `moe experts` "
    "against their share of the HBM floor: what no fusion removes."
)


def _pytest(data: dict) -> list[str]:
    t = data.get("pytest")
    if not t:
        return []
    lines = [
        "## `pytest -m gpu`",
        "",
        f"{t.get('passed', 0)} passed, {t.get('failed', 0)} failed, {t.get('errors', 0)} errors, "
        f"{t.get('skipped', 0)} skipped in {_f(t.get('seconds'), '{:.0f}')} s.",
        "",
    ]
    for f in t.get("failures", []):
        lines += [f"- `{f['test']}`: {f['message'][:300]}"]
    return lines + [""]


def _sim(data: dict, name: str) -> list[str]:
    profiles = data.get("sim_profiles") or []
    if not profiles:
        return []
    lines = [
        f"## sim against real ({name})",
        "",
        "The sim profile of this card with the published efficiencies (mfu 0.6, bandwidth "
        "0.85, docs/sim-profiles.md) models each profiled step; the scale is the real forward "
        "over the modelled step. Paste a profile below into gpu_runner/sim/profiles.py to make "
        "`--sim-profile` model this runner.",
        "",
        "| profile | decode_scale | prefill_scale |",
        "|---|---|---|",
    ]
    for p in profiles:
        lines.append(f"| `{p['name']}` | {p['decode_scale']:.2f} | {p['prefill_scale']:.2f} |")
    return lines + ["", "```json", json.dumps(profiles, indent=1), "```", ""]


def _stages(data: dict) -> list[str]:
    lines = ["## Stages", "", "| stage | status | seconds | note |", "|---|---|---|---|"]
    for s in data["stages"]:
        lines.append(
            f"| {s['name']} | {s['status']} | {_f(s.get('seconds'), '{:.1f}')} | "
            f"{(s.get('note') or '')[:200]} |"
        )
    return lines + [""]
