"""The GPU check's work on the GPU host, one subcommand per process (run.py starts them):

  card     the card's name and memory, and its bf16 matmul peak and HBM bandwidth measured
  models   the shapes' model directories (random weights), each marked done when written
  kernels  the shapes' attention kernels built (flashinfer compiles them at first use)
  profile  shapes in process: a steady decode step and a mixed step, timed and profiled

Each writes JSON (one object, or one line per shape as it finishes) for run.py to read.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

DONE = ".done"  # a model directory or kernel marker is complete once this file exists
TOKENIZER_VOCAB = 49152  # the default model's: prompt ids stay below it


@contextmanager
def quiet(work: Path):
    """run.py pauses its background work (pytest, kernel builds) while this block runs."""
    path = work / "quiet" / f"profile-{os.getpid()}"
    path.parent.mkdir(exist_ok=True)
    path.touch()
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def _emit(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


# ------------------------------------------------------------------------------------- card


def _timed_ms(fn, repeats: int, device: str = "cuda") -> float:
    import torch

    if device != "cuda":
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t0) * 1e3 / repeats
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def matmul_peak(n: int = 8192, device: str = "cuda") -> float:
    """FLOP/s of an n^3 bf16 matmul on random data: the mean of 10 after 3 warm-ups."""
    import torch

    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    _timed_ms(lambda: a @ b, 3, device)
    return 2 * n**3 / (_timed_ms(lambda: a @ b, 10, device) / 1e3)


def bandwidths(gib: float = 4, device: str = "cuda") -> tuple[float, float]:
    """Bytes/s of memory read (a sum over `gib` GiB of bf16) and copied (read + written)."""
    import torch

    x = torch.empty(int(gib * 2**29), dtype=torch.bfloat16, device=device).normal_()
    y = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()
    _timed_ms(lambda: x.sum(dtype=torch.float32), 2, device)
    read_ms = _timed_ms(lambda: x.sum(dtype=torch.float32), 5, device)
    _timed_ms(lambda: y.copy_(x), 2, device)
    copy_ms = _timed_ms(lambda: y.copy_(x), 5, device)
    return nbytes / (read_ms / 1e3), 2 * nbytes / (copy_ms / 1e3)


def cpu_card(out: Path) -> None:
    """The rehearsal's stand-in for a card: this machine's cores, measured the same way."""
    import os

    import torch

    read, copy = bandwidths(0.25, "cpu")
    record = {
        "name": f"cpu ({os.cpu_count()} cores, rehearsal)", "memory_bytes": 0,
        "multiprocessors": os.cpu_count(), "capability": None, "torch": torch.__version__,
        "cuda": None, "flashinfer": None, "bf16_peak_measured": matmul_peak(256, "cpu"),
        "read_bandwidth_measured": read, "copy_bandwidth_measured": copy,
    }  # fmt: skip
    out.write_text(json.dumps(record, indent=1))


def card(out: Path, device: str = "cuda") -> None:
    """The card, its bf16 matmul peak and its HBM bandwidth, measured."""
    import torch

    if device == "cpu":
        return cpu_card(out)
    props = torch.cuda.get_device_properties(0)
    peak = matmul_peak()
    read, copy = bandwidths()
    torch.cuda.empty_cache()
    try:
        import flashinfer

        fi = flashinfer.__version__
    except ImportError:
        fi = None
    record = {
        "name": torch.cuda.get_device_name(0),
        "memory_bytes": props.total_memory,
        "multiprocessors": props.multi_processor_count,
        "capability": f"{props.major}.{props.minor}",
        "l2_bytes": getattr(props, "L2_cache_size", None),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "flashinfer": fi,
        "bf16_peak_measured": peak,
        "read_bandwidth_measured": read,
        "copy_bandwidth_measured": copy,
    }
    out.write_text(json.dumps(record, indent=1))


# ----------------------------------------------------------------------------------- models


def models(work: Path, names: list[str], tokenizer: Path) -> None:
    """Each shape's model directory under work/models, in the order given."""
    from gapless.bench.gpu_check.shapes import SHAPES, write_model

    for name in names:
        out = work / "models" / name
        if (out / DONE).exists():
            continue
        t0 = time.perf_counter()
        write_model(SHAPES[name], out, tokenizer)
        (out / DONE).write_text(f"{time.perf_counter() - t0:.1f}")
        print(f"models: {name} written in {time.perf_counter() - t0:.1f}s", flush=True)


# ---------------------------------------------------------------------------------- kernels


def kernels(work: Path, names: list[str]) -> None:
    """Build each shape's attention kernels: a prompt step and a decode step planned and run
    through the runner's own attention class, on a cache of a few blocks."""
    import numpy as np
    import torch

    from gapless.bench.gpu_check.shapes import SHAPES
    from gapless.gpu_runner.attention import StepLayout
    from gapless.gpu_runner.cuda.flashinfer_attention import FlashinferAttention

    marks = work / "kernels"
    marks.mkdir(parents=True, exist_ok=True)
    bs = 16
    for name in names:
        if (marks / name).exists():
            continue
        t0 = time.perf_counter()
        arch = SHAPES[name].arch()
        attn = FlashinferAttention(arch, bs, 4, torch.bfloat16, torch.device("cuda"))
        cache = [torch.zeros(4 * bs, arch.num_kv_heads, arch.head_dim, dtype=torch.bfloat16,
                             device="cuda") for _ in range(2)]  # fmt: skip
        for tokens in ([5], [1, 1, 1]):  # a prompt step, then a decode step
            n = len(tokens)
            num = np.array(tokens, np.int64)
            layout = StepLayout(num, num, np.arange(n, dtype=np.int64)[:, None] % 4, bs)
            rows = int(num.sum())
            slots = torch.arange(rows, device="cuda")
            meta = attn.build(layout, slots)
            q = torch.randn(rows, arch.num_heads, arch.head_dim, dtype=torch.bfloat16,
                            device="cuda")  # fmt: skip
            k = torch.randn(rows, arch.num_kv_heads, arch.head_dim, dtype=torch.bfloat16,
                            device="cuda")  # fmt: skip
            for window in attn.windows:
                meta.attend(q, k, k, cache[0], cache[1], window, arch.attn_softcap)
        torch.cuda.synchronize()
        (marks / name).write_text(f"{time.perf_counter() - t0:.1f}")
        print(f"kernels: {name} built in {time.perf_counter() - t0:.1f}s", flush=True)


# ---------------------------------------------------------------------------------- profile

CATEGORIES = (  # kernel name pattern -> what it is; first match wins
    (
        "attention",
        r"flashinfer|BatchPrefill|BatchDecode|PrefillWith|DecodeWith|fmha|Attention|"
        r"scaled_dot_product|paged_decode",
    ),  # fmt: skip
    ("moe experts", r"grouped|GroupedMM|group_gemm"),
    (
        "matmul",
        r"gemm|Gemm|GEMM|cutlass|cublas|nvjet|xmma|sm90_|s16816|_mm_|Kernel2|splitK|"
        r"aten::(mm|addmm|bmm|linear)$",
    ),  # fmt: skip
    ("activation", r"silu|gelu|tanh|sigmoid|Silu|Gelu"),
    ("norm", r"rsqrt|pow_tensor|MeanOps|norm|Norm"),
    (
        "sampling",
        r"topk|sort|Sort|argmax|ArgMax|softmax|Softmax|exponential|cumsum|multinomial|"
        r"logsumexp|LogSoftMax|max_kernel|MaxOps",
    ),  # fmt: skip
    ("kv write / rope", r"index_copy|indexCopy|scatter|CatArray|cat_|neg_kernel|index_put"),
    ("copy / cast", r"copy|Copy|Memcpy|Memset|fill|cast"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce_kernel"),
)


def category(name: str) -> str:
    import re

    for label, pattern in CATEGORIES:
        if re.search(pattern, name):
            return label
    return "other"


def kernel_table(prof, steps: int, device: str = "cuda") -> list[dict]:
    """Device kernels of `steps` profiled steps, by name: calls and microseconds per step,
    share of the device time, longest first (on cpu: operators, by their own time)."""
    from torch.autograd import DeviceType

    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        if device == "cuda" and e.device_type == DeviceType.CUDA:
            by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
        elif device == "cpu" and e.device_type == DeviceType.CPU:
            by_name.setdefault(e.name, []).append(e.self_cpu_time_total)
    total = sum(sum(v) for v in by_name.values()) or 1.0
    rows = [
        {
            "name": name,
            "category": category(name),
            "calls_per_step": len(v) / steps,
            "us_per_step": sum(v) / steps,
            "share": sum(v) / total,
        }  # fmt: skip
        for name, v in by_name.items()
    ]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def categories(rows: list[dict]) -> dict[str, float]:
    """Share of the device time per category."""
    out: dict[str, float] = {}
    for r in rows:
        out[r["category"]] = out.get(r["category"], 0.0) + r["share"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


class Driver:
    """Hand-made plans for a runner (its launch / collect contract): slots decoding at a chosen
    context, and prompt slots beside them; blocks handed out in order from block 1."""

    def __init__(self, backend, block_size: int) -> None:
        from gapless.common.messages import SamplingParams

        self.backend = backend
        self.bs = block_size
        self.seq = 0
        self.context: dict[int, int] = {}  # slot -> tokens in its cache
        self.next_block = 1  # block 0 is the padding scratch
        self.params = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)

    def take_blocks(self, n: int) -> list[int]:
        out = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return out

    def plan(self, prompts: dict[int, list[int]], decodes: list[int], freed=(), blocks=None):
        from gapless.common.messages import NewSlot, StepPlan

        self.seq += 1
        entries = [(s, len(p), p) for s, p in prompts.items()] + [(s, 1, None) for s in decodes]
        new_blocks = blocks or {}
        for s in freed:
            self.context.pop(s, None)
        plan = StepPlan(
            seq=self.seq,
            new_slots=[
                NewSlot(slot=s, params=self.params, num_prompt_tokens=len(p))
                for s, p in prompts.items()
            ],
            freed_slots=list(freed),
            slots=[e[0] for e in entries],
            num_tokens=[e[1] for e in entries],
            start_pos=[self.context.get(e[0], 0) for e in entries],
            has_tokens=[e[2] is not None for e in entries],
            token_ids=[t for e in entries if e[2] is not None for t in e[2]],
            sample=[True] * len(entries),
            num_new_blocks=[len(new_blocks.get(e[0], [])) for e in entries],
            new_blocks=[b for e in entries for b in new_blocks.get(e[0], [])],
        )
        for s, n, _ in entries:
            self.context[s] = self.context.get(s, 0) + n
        return plan

    def step(self, plan):
        """Run one plan to its result: (forward ms, whole step ms on the device)."""
        t = self.backend.collect(self.backend.launch(plan)).timing
        return t.forward_s * 1e3, (t.device_end - t.device_start) * 1e3


def start_decoding(driver: Driver, batch: int, context: int, room: int, vocab: int) -> None:
    """`batch` new slots whose caches hold context - 1 tokens (zeros, never computed), each fed
    one token: a decode-shaped first step, after which each slot holds `context` tokens and
    blocks for `room` more."""
    from gapless.common.messages import NewSlot, StepPlan

    blocks = {s: driver.take_blocks(-(-(context + room) // driver.bs)) for s in range(batch)}
    driver.seq += 1
    plan = StepPlan(
        seq=driver.seq,
        new_slots=[
            NewSlot(slot=s, params=driver.params, num_prompt_tokens=context - 1)
            for s in range(batch)
        ],
        freed_slots=[],
        slots=list(range(batch)),
        num_tokens=[1] * batch,
        start_pos=[context - 1] * batch,
        has_tokens=[True] * batch,
        token_ids=[(7 + 13 * s) % vocab for s in range(batch)],
        sample=[True] * batch,
        num_new_blocks=[len(blocks[s]) for s in range(batch)],
        new_blocks=[b for s in range(batch) for b in blocks[s]],
    )
    for s in range(batch):
        driver.context[s] = context
    driver.step(plan)


def decode_plan(driver: Driver, batch: int):
    return driver.plan({}, list(range(batch)))


def mixed_plans(driver: Driver, batch: int, prompts: int, prompt_len: int, reps: int, vocab: int):
    """`reps` steps that each free slots 0..prompts-1, give them new prompts of prompt_len
    (in the same blocks each time) and decode the other slots."""
    import numpy as np

    rng = np.random.default_rng(1)
    per = -(-prompt_len // driver.bs)
    region = driver.take_blocks(prompts * per)
    slots = list(range(prompts))
    blocks = {s: region[i * per : (i + 1) * per] for i, s in enumerate(slots)}
    for _ in range(reps):
        fed = {s: rng.integers(0, vocab, prompt_len).tolist() for s in slots}
        yield driver.plan(fed, list(range(prompts, batch)), freed=slots, blocks=blocks)


def profile_shape(spec: dict, work: Path, peak: float, bandwidth: float) -> dict:
    """One shape in process: its backend's startup, a steady decode step (median of 20 after
    3, then 3 profiled) and a mixed step (median of 3 after 1, then 1 profiled)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from gapless.bench.gpu_check import floors
    from gapless.common.config import EngineConfig
    from gapless.common.model_files import load_arch, resolve_model
    from gapless.gpu_runner.cpu.backend import CpuBackend
    from gapless.gpu_runner.kv_cache import kv_block_bytes

    name, bs = spec["shape"], 16
    batch, context = spec["decode_batch"], spec["decode_context"]
    prompts, prompt_len = spec["mixed_prompts"], spec["mixed_prompt_len"]
    warm, timed, profiled, reps = 3, 20, 3, 5
    first = context - (warm + timed) // 2  # the timed steps centre on `context`
    room = warm + timed + 2 * profiled + reps + 8  # decode steps a slot takes past `first`
    info = resolve_model(str(work / "models" / name), spec.get("max_model_len", 8192))
    arch = load_arch(info)
    blocks = 1 + batch * -(-(first + room) // bs) + prompts * -(-prompt_len // bs)
    device = spec.get("device", "cuda")
    dtype, dtype_name = (torch.bfloat16, "bfloat16") if device == "cuda" else (torch.float32,
                                                                              "float32")  # fmt: skip
    config = EngineConfig(
        model=info, served_model_name=name, device=device, dtype=dtype_name, block_size=bs,
        max_num_seqs=batch, max_num_batched_tokens=prompts * prompt_len + batch, compile=False,
        attention_kernel=device == "cuda",  # cpu (the rehearsal): no C++ build
        kv_cache_memory=blocks * kv_block_bytes(arch, bs, dtype), seed=0,
    )  # fmt: skip
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    t0 = time.perf_counter()
    if device == "cuda":
        from gapless.gpu_runner.cuda.backend import CudaBackend

        backend = CudaBackend(config)
    else:
        backend = CpuBackend(config)
    out: dict = {"shape": name, "startup_s": time.perf_counter() - t0,
                 "startup": getattr(backend, "ready_info", {})}  # fmt: skip
    driver = Driver(backend, bs)
    vocab = min(arch.vocab_size, TOKENIZER_VOCAB)
    with quiet(work):  # the timed sections: run.py pauses its background work
        start_decoding(driver, batch, first, room, vocab)
        times = [driver.step(decode_plan(driver, batch)) for _ in range(warm + timed)][warm:]
        mean_ctx = first + warm + (timed + 1) / 2
        with profile(activities=activities) as prof:
            for _ in range(profiled):
                driver.step(decode_plan(driver, batch))
        table = kernel_table(prof, profiled, device)
        eager = device == "cuda" and len(table) < 3  # no kernels seen inside the graph replays
        if eager:
            graphs = dict(backend.graphs.graphs)
            backend.graphs.graphs.clear()
            with profile(activities=activities) as prof:
                for _ in range(profiled):
                    driver.step(decode_plan(driver, batch))
            backend.graphs.graphs.update(graphs)
            table = kernel_table(prof, profiled, device)
        out["decode"] = step_record(
            arch, floors.decode_entries(batch, round(mean_ctx)), times, bandwidth, peak, table
        )
        out["decode"].update(batch=batch, context=round(mean_ctx), kernels_eager=eager)
        mixed, mixed_table = [], []
        for rep, plan in enumerate(mixed_plans(driver, batch, prompts, prompt_len, reps, vocab)):
            if rep < reps - 1:
                mixed.append(driver.step(plan))
                continue
            with profile(activities=activities) as prof:
                driver.step(plan)
            mixed_table = kernel_table(prof, 1, device)
    entries = [floors.Entry(prompt_len, prompt_len)] * prompts
    entries += floors.decode_entries(batch - prompts, driver.context[batch - 1])
    out["mixed"] = step_record(arch, entries, mixed[1:], bandwidth, peak, mixed_table)
    out["mixed"].update(prompts=prompts, prompt_len=prompt_len, decodes=batch - prompts,
                        tokens=prompts * prompt_len + batch - prompts)  # fmt: skip
    del backend, driver
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def step_record(arch, entries, times, bandwidth: float, peak: float, table: list[dict]) -> dict:
    """A timed step against its floors: times are (forward ms, whole step ms) per run."""
    from gapless.bench.gpu_check import floors

    cost = floors.step_cost(arch, entries)
    fl = floors.floors(cost, bandwidth, peak)
    forward = statistics.median(t[0] for t in times)
    whole = statistics.median(t[1] for t in times)
    return {
        "forward_ms": forward, "step_ms": whole, "runs": len(times),
        "bytes": cost.bytes, "weight_bytes": cost.weight_bytes,
        "kv_bytes": cost.kv_read_bytes + cost.kv_write_bytes, "flops": cost.flops,
        "hbm_floor_ms": fl.hbm_s * 1e3, "flop_floor_ms": fl.flop_s * 1e3, "bound": fl.bound,
        "ratio": forward / (fl.floor_s * 1e3), "hbm_ratio": forward / (fl.hbm_s * 1e3),
        "tflops": cost.flops / (forward / 1e3) / 1e12, "peak_share": fl.flop_s * 1e3 / forward,
        "kernels": table[:20], "categories": categories(table),
        "kernel_ms": sum(r["us_per_step"] for r in table) / 1e3,  # device busy in the step
    }  # fmt: skip


def profiles(work: Path, specs: list[dict], out: Path, card_json: Path, deadline: float) -> None:
    from gapless.bench.gpu_check import floors

    card = json.loads(card_json.read_text())
    datasheet = floors.card(card["name"])
    bandwidth = datasheet.hbm_bandwidth or card["read_bandwidth_measured"]
    peak = card["bf16_peak_measured"]
    for spec in specs:
        if time.time() > deadline:
            _emit(out, {"shape": spec["shape"], "skipped": "out of time"})
            continue
        marker = work / "models" / spec["shape"] / DONE
        while not marker.exists() and time.time() < deadline:
            time.sleep(0.5)
        t0 = time.perf_counter()
        try:
            record = profile_shape(spec, work, peak, bandwidth)
        except Exception as e:  # one shape's failure is reported, the others still run
            import traceback

            record = {"shape": spec["shape"], "error": f"{type(e).__name__}: {e}",
                      "traceback": traceback.format_exc()[-3000:]}  # fmt: skip
            gc.collect()
        record["seconds"] = time.perf_counter() - t0
        _emit(out, record)
        print(f"profile: {spec['shape']} in {record['seconds']:.1f}s", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m gapless.bench.gpu_check.steps")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("card")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    m = sub.add_parser("models")
    m.add_argument("--work", type=Path, required=True)
    m.add_argument("--tokenizer", type=Path, required=True)
    m.add_argument("shapes", nargs="+")
    k = sub.add_parser("kernels")
    k.add_argument("--work", type=Path, required=True)
    k.add_argument("shapes", nargs="+")
    f = sub.add_parser("profile")
    f.add_argument("--work", type=Path, required=True)
    f.add_argument("--card", type=Path, required=True)
    f.add_argument("--out", type=Path, required=True)
    f.add_argument("--deadline", type=float, required=True, help="time.time() to stop by")
    f.add_argument("specs", help="JSON list of {shape, decode_batch, decode_context, ...}")
    args = p.parse_args(argv)
    if args.cmd == "card":
        card(args.out, args.device)
    elif args.cmd == "models":
        models(args.work, args.shapes, args.tokenizer)
    elif args.cmd == "kernels":
        kernels(args.work, args.shapes)
    else:
        profiles(args.work, json.loads(args.specs), args.out, args.card, args.deadline)


if __name__ == "__main__":
    main(sys.argv[1:])
