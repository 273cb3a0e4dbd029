"""`bench embeddings`: how fast a server embeds: requests of INPUTS inputs of TOKENS token ids
each (random ids of the vocabulary's lower part, the same for every server), sent one after
another after a warm-up request, as inputs/s and prompt tokens/s (the best and the median).

bench embeddings --launch -- --device cpu                 (the default model, 64 x 128)
bench embeddings --base-url http://127.0.0.1:8080 --inputs 64 --tokens 128 --batch 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import ExitStack

import httpx
import numpy as np

from gapless.bench.launch import launched_server
from gapless.bench.serve_args import split_serve_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench embeddings", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--base-url", help="an OpenAI-compatible server with /v1/embeddings")
    p.add_argument("--launch", action="store_true", help="start `gapless serve` (args after --)")
    p.add_argument("--model", help="model name to send (default: the first of /v1/models)")
    p.add_argument("--inputs", type=int, default=64, help="inputs per round (64)")
    p.add_argument("--tokens", type=int, default=128, help="token ids per input (128)")
    p.add_argument("--batch", type=int, default=0, help="inputs per request; 0: all in one")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds after a warm-up (5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", help="write the figures here too")
    return p


def inputs_of(n: int, tokens: int, seed: int) -> list[list[int]]:
    """n lists of `tokens` ids in [100, 10000): plain tokens of any byte-level vocabulary."""
    rng = np.random.default_rng(seed)
    return rng.integers(100, 10_000, (n, tokens)).tolist()


def one_round(client: httpx.Client, model: str, inputs: list[list[int]], batch: int) -> float:
    """Seconds to embed every input, `batch` per request, one request after another."""
    t0 = time.perf_counter()
    for start in range(0, len(inputs), batch):
        body = {"model": model, "input": inputs[start : start + batch], "encoding_format": "base64"}
        r = client.post("/v1/embeddings", json=body)
        r.raise_for_status()
        assert len(r.json()["data"]) == len(body["input"]), r.text[:200]
    return time.perf_counter() - t0


def run(url: str, args: argparse.Namespace) -> dict:
    with httpx.Client(base_url=url, timeout=600) as client:
        model = args.model or client.get("/v1/models").json()["data"][0]["id"]
        inputs = inputs_of(args.inputs, args.tokens, args.seed)
        batch = args.batch or args.inputs
        one_round(client, model, inputs, batch)  # warm-up
        times = [one_round(client, model, inputs, batch) for _ in range(args.rounds)]
    best, median = min(times), statistics.median(times)
    return {
        "base_url": url,
        "model": model,
        "inputs": args.inputs,
        "tokens": args.tokens,
        "batch": batch,
        "round_s": times,
        "inputs_per_s": {"best": args.inputs / best, "median": args.inputs / median},
        "tokens_per_s": {
            "best": args.inputs * args.tokens / best,
            "median": args.inputs * args.tokens / median,
        },
    }


def main(argv: list[str]) -> None:
    argv, serve_args = split_serve_args(argv)
    args = build_parser().parse_args(argv)
    if not (args.launch or args.base_url):
        sys.exit("bench embeddings: name a server: --base-url URL or --launch")
    with ExitStack() as stack:
        url = args.base_url or stack.enter_context(launched_server(serve_args))
        result = run(url, args)
    rate, tok = result["inputs_per_s"], result["tokens_per_s"]
    print(f"{args.inputs} inputs x {args.tokens} tokens, {result['batch']} per request: "
          f"{rate['best']:.1f} inputs/s best, {rate['median']:.1f} median "
          f"({tok['best']:.0f} / {tok['median']:.0f} tokens/s)")  # fmt: skip
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
