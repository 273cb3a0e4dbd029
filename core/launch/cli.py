"""`gapless serve` and `gapless bench`."""

from __future__ import annotations

import argparse
import os
import re
import sys

from gapless.core.common.config import EngineConfig
from gapless.gpu_runner.sim_profiles import list_profiles

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def parse_bytes(text: str) -> int:
    """'512MiB', '2G', '1.5GiB' or a plain number of bytes."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([kmg]i?)?b?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512MiB or 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def default_threads() -> int:
    # measured on 2 cores, 32 x 128:128 through HTTP: 2 threads 133.7 tok/s, 1 thread 106.8 tok/s;
    # the other roles are light and run at lower priority, so the runner takes every core
    return max(1, os.cpu_count() or 1)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", help="Hugging Face directory or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    p.add_argument("--served-model-name", help="model name clients send (default: from --model)")
    p.add_argument("--device", choices=["cpu", "sim", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default="bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per step")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default="512MiB", help="KV cache size")
    p.add_argument("--max-model-len", type=int, help="cap on the model's context length")
    p.add_argument(
        "--no-overlap", action="store_true", help="run one step at a time (for A/B runs)"
    )
    p.add_argument("--threads", type=int, default=default_threads(), help="torch threads on cpu")
    p.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")
    p.add_argument(
        "--sim-profile",
        default="h100-llama3-8b",
        choices=list_profiles(),
        help="timing profile of --device sim (docs/sim-profiles.md); the KV capacity "
        "comes from the profile, --model gives the tokenizer and context length",
    )
    p.add_argument("--no-cuda-graph", action="store_true", help="run cuda decode steps eagerly")
    p.add_argument("--trace-file", help="write the device timeline as a Chrome trace here")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("GAPLESS_API_KEY"),
        help="required as 'Authorization: Bearer KEY' (default: $GAPLESS_API_KEY)",
    )
    p.add_argument("--api-servers", type=int, default=1, help="frontend processes sharing the port")
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--max-n", type=int, default=8)
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds SIGTERM waits for in-flight requests",
    )


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    from gapless.core.common.model_cache import DEFAULT_NAME
    from gapless.core.common.model_files import resolve_model

    info = resolve_model(args.model, args.max_model_len)
    if args.served_model_name:
        name = args.served_model_name
    elif args.model:
        name = os.path.basename(os.path.normpath(args.model)).removesuffix(".gguf")
    else:
        name = DEFAULT_NAME
    return EngineConfig(
        model=info,
        served_model_name=name,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        overlap=not args.no_overlap,
        threads=args.threads,
        seed=args.seed,
        sim_profile=args.sim_profile,
        cuda_graph=not args.no_cuda_graph,
        trace_file=args.trace_file,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        api_servers=args.api_servers,
        max_logprobs=args.max_logprobs,
        max_n=args.max_n,
        drain_timeout_s=args.drain_timeout,
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the bench CLI owns its own flags
        from gapless.bench.cli import main as bench_main

        bench_main(argv[1:])
        return
    parser = argparse.ArgumentParser(prog="gapless", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve_p = sub.add_parser("serve", help="start the OpenAI-compatible server")
    add_serve_args(serve_p)
    sub.add_parser("bench", help="measure a server: TTFT, throughput, device idle (bench --help)")
    args = parser.parse_args(argv)
    if args.command == "serve":
        from gapless.core.launch.supervisor import serve

        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "threads",
            "api_servers",
        ):
            if getattr(args, name) < 1:
                parser.error(f"--{name.replace('_', '-')} must be at least 1")
        try:
            config = config_from_args(args)
        except (ValueError, FileNotFoundError, NotImplementedError, RuntimeError) as e:
            parser.exit(2, f"gapless: {e}\n")
        sys.exit(serve(config))


if __name__ == "__main__":
    main()
