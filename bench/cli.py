"""`bench`: streams /v1/completions load at OpenAI-compatible servers and reports what it saw.

bench --base-url http://127.0.0.1:8000 --workload 1024:64
bench --launch --workload sharegpt -- --model ./my-model --max-num-seqs 128
bench --target gapless=http://a:8000 --target other=http://b:8080 --output-json r.json
bench --launch --tenants noisy-neighbor --plot-dir figs -- --device sim
bench --launch --workload prefix:1024:32-128:64 --workload chat:32:4:64:64:1 -- --device sim
bench plot --from a.json b.json --plot-dir figs
bench host-floor --batches 64,256 --plot-dir figs   (the shortest sim step the host keeps fed)
bench sse-ceiling --streams 256 --api-servers 1,2   (tokens/s the frontends deliver, engine no limit)
bench connections --idle 20000 --slowloris 100 --launch -- --device sim   (held sockets beside a client)
bench route --groups 12 --prefix 512 -- --device sim   (KV-event routing vs round robin, two servers)
bench kv-stall --streams 256 --seconds 10 -- --device sim   (a KV event subscriber that stops reading)
bench embeddings --launch -- --device cpu   (/v1/embeddings: 64 inputs x 128 tokens, inputs/s)
bench spec-exact --draft-model DIR -- --model DIR   (speculation's tokens against off's, in process)
bench spec-tenants --requests 200   (a copying and a chatting tenant: tokens verified each, sim)
bench spec-host --streams 8,32,256   (the host's ms per steady step, drafts on or off, sim)
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import uvloop

from gapless.bench.loadgen import LoadSpec
from gapless.bench.report import (
    format_ratios,
    format_run,
    format_tenants,
    format_tenants_by_target,
    ratios,
)
from gapless.bench.serve_args import split_serve_args
from gapless.bench.targets import Target, normalize_url, parse_target, served_model, url_name
from gapless.bench.tenants import TenantSpec, parse_tenants, read_tenants_file, specs_checked
from gapless.bench.workloads import is_known

JSON_SHAPE = """\
--output-json: one run (one target, one workload) is written as a JSON object; several runs as
{"runs": [run, ...], "ratios": [...]}, ratios being each later target over the first target on
the same workload. A run holds target, base_url, model, workload, num_requests, completed,
failed, errors, duration_s, request_throughput, output_token_throughput, ttft_ms, tpot_ms,
itl_ms, e2e_ms ({mean, p50, p90, p99} in ms), total_cached_tokens and cached_token_fraction
(prompt tokens the server reported as cached, usage.prompt_tokens_details; null if it did not), device ("cpu", "cuda", "sim:<profile>"; null
without an engine timeline), overlap, device_idle_fraction, step_breakdown_ms (median ms per
step of schedule, prepare_inputs, forward, sample, apply_result), timeline and samples
(per-request latencies for CDF plots). A multi-tenant run (--tenants) adds `tenants`, one object
per tenant: name, priority, weight, start_s, again_s, rate, input_len, output_len, num_requests,
completed, failed, ttft_ms, tokens_received, output_token_throughput (tok/s from its first send
to its last token), first_send_s, last_token_s, window_tokens, window_share, weight_share and
series ({t_s, tokens}: cumulative output tokens received, s after the run's start); and
`fairness`: window_start_s, window_end_s, window_s, jain_index and note (why jain_index is
null). The backlogged window runs from the latest tenant's first send to the earliest time a
tenant's last request got its first token (then it has nothing waiting); jain_index is (sum x)^2 / (n sum x^2) over x = a tenant's
tokens received in the window divided by its weight."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench",
        description=__doc__,
        epilog=JSON_SHAPE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    to = p.add_argument_group("targets (the first one is the baseline of the ratio table)")
    to.add_argument(
        "--launch",
        action="store_true",
        help="start `gapless serve` on a free port (arguments after -- go to it), stop it after",
    )
    to.add_argument("--base-url", help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    to.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="a named server; repeat to send the same requests to each in turn",
    )
    to.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' to every target")
    to.add_argument("--model", help="model name to request (default: first id of /v1/models)")
    wo = p.add_argument_group("workload")
    wo.add_argument(
        "--workload",
        action="append",
        metavar="SPEC",
        help="IN:OUT (fixed synthetic lengths, e.g. 1024:64), sharegpt, loogle, "
        "prefix:S:Q:OUT (a shared S-token system prompt, then a unique Q-token question, Q is N "
        "or LO-HI; --num-requests of them), or chat:SESSIONS:TURNS:USER:OUT[:THINK_S] "
        "(multi-turn sessions resending their history each turn, THINK_S s between turns; "
        "--num-requests does not apply); repeatable (default: 1024:64)",
    )
    wo.add_argument(
        "--tenants",
        metavar="SPEC",
        help="a multi-tenant run instead of --workload: NAME:n=N,in=LEN,out=LEN[,start=S]"
        "[,rate=R][,priority=P][,weight=W][,again=S+S] parts joined by ';' (LEN is N or LO-HI; "
        "again: n more requests at each of those times), or the "
        "preset noisy-neighbor (A: 200 requests at once, out 16-256; B: 1 request 1 s later)",
    )
    wo.add_argument(
        "--tenants-file",
        metavar="JSON",
        help='tenants as JSON: [{"name": "A", "n": 200, "in": 128, "out": "16-256", ...}]',
    )
    wo.add_argument("--dataset", help="ShareGPT or LooGLE JSON (default: a synthetic length mix)")
    wo.add_argument(
        "--tokenizer",
        help="model dir or .gguf whose tokenizer measures prompts "
        "(default: the --model given after --launch, else SmolLM2-135M-Instruct)",
    )
    wo.add_argument("--num-requests", type=int, help="(default: 300)")
    wo.add_argument(
        "--request-rate",
        type=float,
        help="requests/s, Poisson arrivals (default: inf, all at once)",
    )
    wo.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    wo.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals")
    wo.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="ask for exactly max_tokens (default: on for synthetic workloads, off for datasets)",
    )
    wo.add_argument("--temperature", type=float, default=0.0)
    wo.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    out = p.add_argument_group("output")
    out.add_argument("--output-json", help="write the results here")
    out.add_argument("--plot-dir", help="write PNG figures here")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def build_plot_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench plot", description="figures from saved --output-json files"
    )
    p.add_argument("--from", dest="sources", nargs="+", required=True, metavar="JSON")
    p.add_argument("--plot-dir", required=True)
    return p


def _flag_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def tenants_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[TenantSpec, ...]:
    """The --tenants and --tenants-file tenants, in that order; () without either."""
    if args.tenants is None and args.tenants_file is None:
        return ()
    for flag, value in (
        ("--workload", args.workload),
        ("--num-requests", args.num_requests),
        ("--request-rate", args.request_rate),
        ("--dataset", args.dataset),
    ):
        if value is not None:
            parser.error(
                f"{flag} does not apply to --tenants (give n=, rate=, in=, out= per tenant)"
            )
    from_spec: tuple[TenantSpec, ...] = ()
    from_file: tuple[TenantSpec, ...] = ()
    try:
        from_spec = () if args.tenants is None else parse_tenants(args.tenants)
    except ValueError as exc:
        parser.error(f"--tenants: {exc}")
    try:
        from_file = () if args.tenants_file is None else read_tenants_file(args.tenants_file)
    except ValueError as exc:
        parser.error(f"--tenants-file {exc}")
    try:
        return specs_checked([*from_spec, *from_file])
    except ValueError as exc:
        parser.error(f"--tenants with --tenants-file: {exc}")


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["host-floor"]:
        from gapless.bench.host_floor import main as host_floor_main

        host_floor_main(argv[1:])
        return
    if argv[:1] == ["sse-ceiling"]:
        from gapless.bench.sse_ceiling import main as sse_ceiling_main

        sse_ceiling_main(argv[1:])
        return
    if argv[:1] == ["kv-stall"]:
        from gapless.bench.kv_stall import main as kv_stall_main

        sys.exit(kv_stall_main(argv[1:]))
    if argv[:1] == ["route"]:
        from gapless.bench.routing import main as route_main

        sys.exit(route_main(argv[1:]))
    if argv[:1] == ["embeddings"]:
        from gapless.bench.embeddings import main as embeddings_main

        embeddings_main(argv[1:])
        return
    if argv[:1] == ["connections"]:
        from gapless.bench.connections import main as connections_main

        sys.exit(connections_main(argv[1:]))
    if argv[:1] == ["edit"]:
        from gapless.bench.edit import main as edit_main

        sys.exit(edit_main(argv[1:]))
    if argv[:1] == ["spec-host"]:
        from gapless.bench.spec_host import main as spec_host_main

        sys.exit(spec_host_main(argv[1:]))
    if argv[:1] == ["spec-tenants"]:
        from gapless.bench.spec_tenants import main as spec_tenants_main

        sys.exit(spec_tenants_main(argv[1:]))
    if argv[:1] == ["spec-cost"]:
        from gapless.bench.spec_cost import main as spec_cost_main

        sys.exit(spec_cost_main(argv[1:]))
    if argv[:1] == ["spec-exact"]:
        from gapless.bench.spec_exact import main as spec_exact_main

        sys.exit(spec_exact_main(argv[1:]))
    if argv[:1] == ["plot"]:
        args = build_plot_parser().parse_args(argv[1:])
        from gapless.bench.figures import plot_saved

        for path in plot_saved([Path(s) for s in args.sources], Path(args.plot_dir)):
            print(f"wrote {path}")
        return
    parser = build_parser()
    argv, serve_args = split_serve_args(argv)
    args = parser.parse_args(argv)
    if serve_args and not args.launch:
        parser.error("arguments after -- are for gapless serve; add --launch")
    if not (args.launch or args.base_url or args.target):
        parser.error("name a server: --base-url URL, --target NAME=URL or --launch")
    args.tenant_specs = tenants_of(parser, args)
    args.workload = args.workload or ([] if args.tenant_specs else ["1024:64"])
    args.num_requests = 300 if args.num_requests is None else args.num_requests
    args.request_rate = float("inf") if args.request_rate is None else args.request_rate
    for spec in args.workload:
        if not is_known(spec):
            parser.error(
                f"unknown workload {spec!r}: use IN:OUT (e.g. 1024:64), sharegpt, loogle, "
                "prefix:S:Q:OUT or chat:SESSIONS:TURNS:USER:OUT[:THINK_S]"
            )
    if args.num_requests < 1 or (args.max_concurrency is not None and args.max_concurrency < 1):
        parser.error("--num-requests and --max-concurrency must be at least 1")
    if not args.request_rate > 0:
        parser.error("--request-rate must be positive (inf sends everything at once)")
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        sys.exit(run(args, serve_args))
    except KeyboardInterrupt:
        print("bench: interrupted", file=sys.stderr)
        sys.exit(130)
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"bench: {exc}", file=sys.stderr)
        sys.exit(1)


def run(args: argparse.Namespace, serve_args: list[str]) -> int:
    from gapless.bench.launch import launched_server

    with ExitStack() as stack:
        targets = []
        if args.launch:
            print("bench: starting gapless serve ...", file=sys.stderr)
            url = stack.enter_context(launched_server(serve_args))
            targets.append(Target("gapless", url, args.api_key))
        if args.base_url:
            url = normalize_url(args.base_url)
            targets.append(Target(url_name(url), url, args.api_key))
        targets += [parse_target(spec, args.api_key) for spec in args.target]
        names = [t.name for t in targets]
        if len(set(names)) != len(names):
            raise ValueError(f"target names must differ, got {names}")
        tokenizer = args.tokenizer or (_flag_value(serve_args, "--model") if args.launch else None)
        return bench_targets(args, targets, tokenizer)


def bench_targets(args: argparse.Namespace, targets: list[Target], tokenizer: str | None) -> int:
    from gapless.bench.prompts import PromptMaker
    from gapless.bench.run import bench_target
    from gapless.bench.tenants import build_tenant_workload
    from gapless.bench.workloads import build_workload
    from gapless.common.model_files import load_tokenizer, resolve_model

    served = {t.name: served_model(t) for t in targets}
    limits = [s.max_model_len for s in served.values() if s.max_model_len]
    info = resolve_model(tokenizer or None)
    maker = PromptMaker(load_tokenizer(info), info.add_bos_token)
    cap = min(limits) if limits else None
    workloads = [
        build_workload(
            spec,
            maker,
            num_requests=args.num_requests,
            seed=args.seed,
            dataset=args.dataset,
            max_model_len=cap,
        )
        for spec in args.workload
    ]
    if args.tenant_specs:
        workloads.append(
            build_tenant_workload(args.tenant_specs, maker, seed=args.seed, max_model_len=cap)
        )
    runs, steps_of = [], {}
    for workload in workloads:
        load = LoadSpec(
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            seed=args.seed,
            ignore_eos=workload.synthetic if args.ignore_eos is None else args.ignore_eos,
            eos_token_ids=tuple(info.eos_token_ids),
            temperature=args.temperature,
            request_timeout_s=args.request_timeout,
            progress=not args.no_progress,
        )
        for target in targets:
            model = args.model or served[target.name].id
            run, steps = uvloop.run(bench_target(target, model, workload, load))
            runs.append(run)
            steps_of[len(runs) - 1] = steps
            print(format_run(run), flush=True)
            if run.get("tenants"):
                print(format_tenants(run), flush=True)
    table = ratios(runs)
    if table:
        print(format_ratios(table))
    if by_target := format_tenants_by_target(runs):
        print(by_target)
    if args.output_json:
        doc: Any = runs[0] if len(runs) == 1 else {"runs": runs, "ratios": table}
        path = Path(args.output_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1, allow_nan=False))
        print(f"bench: wrote {path}", file=sys.stderr)
    if args.plot_dir:
        from gapless.bench.figures import plot_runs

        for path in plot_runs(runs, [steps_of[i] for i in range(len(runs))], Path(args.plot_dir)):
            print(f"bench: wrote {path}", file=sys.stderr)
    return 0 if all(r["completed"] for r in runs) else 1


if __name__ == "__main__":
    main()
