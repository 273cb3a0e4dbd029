"""Multi-tenant workloads: who sends what and when, from `--tenants` specs, a JSON file or a preset.

    --tenants "A:n=200,in=128,out=16-256,start=0;B:n=1,in=128,out=64,start=1,priority=interactive"
    --tenants noisy-neighbor
    --tenants-file tenants.json   # {"tenants": [{"name": "A", "n": 200, "in": 128, "out": "16-256"}]}

Keys: n (requests), in and out (tokens: N or LO-HI, drawn uniformly with the run's seed) are
required; start (s after the run starts, default 0), rate (requests/s, Poisson; default all at
once at start), priority (an int or interactive/default/batch; default: not sent) and weight
(> 0, default 1; informational, the server decides weights) and again (S or S+S+...: s after
the run starts at which the tenant sends n more the same way, e.g. a tenant that leaves and comes
back) are optional.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gapless.bench.loadgen import arrival_offsets
from gapless.bench.prompts import PromptMaker
from gapless.bench.workloads import BenchRequest, Workload

PRIORITIES = ("interactive", "default", "batch")
NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")
REQUIRED = ("n", "in", "out")
OPTIONAL = ("start", "rate", "priority", "weight", "again")
EXAMPLE = "A:n=200,in=128,out=16-256,start=0;B:n=1,in=128,out=64,start=1"


@dataclass(frozen=True)
class Lengths:
    """Token counts drawn uniformly from [low, high]; one value when low == high."""

    low: int
    high: int

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"

    def draw(self, rng: np.random.Generator, n: int) -> list[int]:
        return rng.integers(self.low, self.high + 1, size=n).tolist()


@dataclass(frozen=True)
class TenantSpec:
    name: str  # sent as X-Tenant and as the `user` field
    num_requests: int
    input_len: Lengths
    output_len: Lengths
    start_s: float = 0.0  # s after the run starts
    rate: float = math.inf  # requests/s, Poisson from start_s; inf sends all at start_s
    priority: int | str | None = None  # sent as the `priority` field when set
    weight: float = 1.0  # the share the tenant should get, relative to the others
    again_s: tuple[float, ...] = ()  # later send times (s after the run starts): n more at each

    @property
    def starts(self) -> tuple[float, ...]:
        return (self.start_s, *self.again_s)


NOISY_NEIGHBOR = (
    TenantSpec("A", 200, Lengths(128, 128), Lengths(16, 256), start_s=0.0),
    TenantSpec("B", 1, Lengths(128, 128), Lengths(64, 64), start_s=1.0),
)
PRESETS = {"noisy-neighbor": NOISY_NEIGHBOR}


def parse_tenants(text: str) -> tuple[TenantSpec, ...]:
    """The tenants of a `--tenants` value: `NAME:key=value,...` parts joined by `;`, any of which
    may be a preset's name."""
    specs: list[TenantSpec] = []
    for part in (p.strip() for p in text.split(";")):
        if part in PRESETS:
            specs += PRESETS[part]
        elif ":" in part:
            name, _, rest = part.partition(":")
            specs.append(tenant_from_fields(name.strip(), _key_values(name.strip(), rest)))
        elif part:
            raise ValueError(
                f"{part!r} is neither a preset ({', '.join(PRESETS)}) nor NAME:key=value,... "
                f"(e.g. {EXAMPLE})"
            )
    if not specs:
        raise ValueError(f"no tenants in {text!r} (e.g. {EXAMPLE} or noisy-neighbor)")
    return specs_checked(specs)


def read_tenants_file(path: str | Path) -> tuple[TenantSpec, ...]:
    """Tenants of a JSON file: a list of objects with a `name` and the keys of the spec, or
    {"tenants": [...]}; `in`/`out` may also be [LO, HI]."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: {exc}") from exc
    items = doc.get("tenants") if isinstance(doc, dict) else doc
    if not isinstance(items, list) or not items:
        raise ValueError(f'{path}: want a non-empty list of tenants or {{"tenants": [...]}}')
    specs = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ValueError(f"{path}: tenant #{i + 1} is not an object with a string name")
        fields = {k: v for k, v in item.items() if k != "name"}
        try:
            specs.append(tenant_from_fields(item["name"], fields))
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc
    return specs_checked(specs)


def specs_checked(specs: list[TenantSpec]) -> tuple[TenantSpec, ...]:
    names = [s.name for s in specs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"tenant names must differ: {', '.join(repeated)} given twice")
    return tuple(specs)


def _key_values(name: str, text: str) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for item in (i.strip() for i in text.split(",")):
        key, eq, value = (s.strip() for s in item.partition("="))
        if not eq or not key or "=" in value:
            raise ValueError(f"tenant {name!r}: {item!r} is not key=value (keys join with ',')")
        if key in fields:
            raise ValueError(f"tenant {name!r}: {key} given twice")
        fields[key] = value
    return fields


def tenant_from_fields(name: str, fields: dict[str, Any]) -> TenantSpec:
    """One tenant from key -> value (strings from the command line, JSON values from a file)."""
    if not NAME.fullmatch(name):
        raise ValueError(
            f"tenant name {name!r}: use 1-64 letters, digits, '_', '-', '.' or '@' "
            "(it travels in an HTTP header)"
        )
    unknown = sorted(set(fields) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        keys = ", ".join(REQUIRED + OPTIONAL)
        raise ValueError(f"tenant {name!r}: unknown key {', '.join(unknown)} (keys: {keys})")
    missing = [k for k in REQUIRED if k not in fields]
    if missing:
        raise ValueError(f"tenant {name!r}: missing {', '.join(missing)} (e.g. {EXAMPLE})")

    def field(key: str, convert: Any, default: Any = None) -> Any:
        if key not in fields:
            return default
        try:
            return convert(fields[key])
        except (ValueError, TypeError) as exc:
            raise ValueError(f"tenant {name!r}: {key}={fields[key]!r}: {exc}") from None

    return TenantSpec(
        name,
        field("n", _count),
        field("in", lambda v: _lengths(v, 2)),  # why 2: as IN:OUT workloads, BOS plus a word
        field("out", lambda v: _lengths(v, 1)),
        start_s=field("start", _seconds, 0.0),
        rate=field("rate", _rate, math.inf),
        priority=field("priority", _priority),
        weight=field("weight", _weight, 1.0),
        again_s=field("again", _times, ()),
    )


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError("want an integer")
    if isinstance(value, str) and not re.fullmatch(r"\s*-?\d+\s*", value):
        raise ValueError("want an integer")
    return int(value)


def _float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError("want a number")
    return float(value)


def _count(value: Any) -> int:
    n = _int(value)
    if n < 1:
        raise ValueError("want at least 1 request")
    return n


def _lengths(value: Any, least: int) -> Lengths:
    if isinstance(value, list) and len(value) == 2:
        low, high = _int(value[0]), _int(value[1])
    elif isinstance(value, str) and "-" in value.strip().lstrip("-"):
        low_text, _, high_text = value.partition("-")
        low, high = _int(low_text), _int(high_text)
    else:
        low = high = _int(value)
    if low < least or high < low:
        raise ValueError(f"want N or LO-HI tokens with {least} <= LO <= HI")
    return Lengths(low, high)


def _seconds(value: Any) -> float:
    s = _float(value)
    if not (math.isfinite(s) and s >= 0):
        raise ValueError("want seconds >= 0")
    return s


def _times(value: Any) -> tuple[float, ...]:
    """S or S+S+... (a list in JSON): seconds after the run starts."""
    items = value.split("+") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        items = [items]
    return tuple(sorted(_seconds(v) for v in items))


def _rate(value: Any) -> float:
    r = _float(value)
    if not r > 0:
        raise ValueError("want requests/s > 0 (inf sends all at the start)")
    return r


def _priority(value: Any) -> int | str:
    if isinstance(value, str) and value.strip() in PRIORITIES:
        return value.strip()
    try:
        return _int(value)
    except ValueError:
        raise ValueError(f"want an integer or one of {', '.join(PRIORITIES)}") from None


def _weight(value: Any) -> float:
    w = _float(value)
    if not (math.isfinite(w) and w > 0):
        raise ValueError("want a weight > 0")
    return w


def workload_name(specs: tuple[TenantSpec, ...]) -> str:
    """The preset's name when the tenants are a preset, else `tenants:A+B+...`."""
    for name, preset in PRESETS.items():
        if specs == preset:
            return name
    return "tenants:" + "+".join(s.name for s in specs)


def build_tenant_workload(
    specs: tuple[TenantSpec, ...],
    maker: PromptMaker,
    *,
    seed: int = 0,
    max_model_len: int | None = None,
) -> Workload:
    """Every tenant's requests, each with its tenant, priority and send time; the same seed
    gives the same lengths, prompts and arrivals."""
    rng = np.random.default_rng(seed)
    reqs: list[BenchRequest] = []
    for i, t in enumerate(specs):
        n = t.num_requests * len(t.starts)
        ins, outs = t.input_len.draw(rng, n), t.output_len.draw(rng, n)
        if max_model_len is not None and t.input_len.high + t.output_len.high > max_model_len:
            raise ValueError(
                f"tenant {t.name!r}: in + out can reach "
                f"{t.input_len.high + t.output_len.high} tokens, over the server's "
                f"max_model_len {max_model_len}"
            )
        offsets = arrival_offsets(t.num_requests, t.rate, seed + 1 + i)
        sends = np.concatenate([start + offsets for start in t.starts])
        prompts = maker.make_many(ins, rng)
        reqs += [
            BenchRequest(p, n_in, n_out, tenant=t.name, priority=t.priority, arrival_s=float(a))
            for p, n_in, n_out, a in zip(prompts, ins, outs, sends, strict=True)
        ]
    # requests due at the same time go out one tenant after another, not tenant by tenant:
    # two tenants that burst together should not reach the server as one queue and then another
    seen: Counter[tuple[str | None, float | None]] = Counter()
    rank = []  # how many of its tenant's requests are due at the same time before it
    for r in reqs:
        rank.append(seen[r.tenant, r.arrival_s])
        seen[r.tenant, r.arrival_s] += 1
    order = sorted(range(len(reqs)), key=lambda i: (reqs[i].arrival_s, rank[i]))
    return Workload(
        workload_name(specs), tuple(reqs[i] for i in order), synthetic=True, tenants=specs
    )
