"""`gapless bench edit`: the edit workload for speculative decoding, one stream.

Sixteen prompts committed in bench/data/edit_prompts.json, half code and half prose, each a
block of about 400 tokens and an instruction to rewrite it with one change. Each prompt goes to
every target in turn (on, off, on, off, ...: alternation, so a drift of the machine hits both),
as a chat completion at temperature 0. `--prediction` sends the block as OpenAI's `prediction`.
Reported per target: output tokens per second (output tokens only, over the requests' wall
time); per prompt: the acceptance rate (accepted / drafted tokens) and the mean accepted length
(accepted drafts per verifying step), read from the target's /metrics around the request.

    python -m gapless.bench.cli edit --target on=http://127.0.0.1:8001 \\
        --target off=http://127.0.0.1:8002 --max-tokens 256
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

PROMPTS = Path(__file__).parent / "data" / "edit_prompts.json"
# key -> (series, a label it must carry)
SERIES = {
    "drafted": ("gapless_spec_draft_tokens_total{", ""),
    "accepted": ("gapless_spec_accepted_tokens_total{", ""),
    "rows": ("gapless_spec_position_drafted_total{", 'position="0"'),  # verifying rows
}


def load_prompts() -> list[dict[str, str]]:
    return json.loads(PROMPTS.read_text())


def spec_counters(client: httpx.Client, url: str) -> dict[str, float]:
    """Drafted and accepted tokens and verifying rows so far, summed over labels."""
    text = client.get(url + "/metrics").text
    sums = dict.fromkeys(SERIES, 0.0)
    for line in text.splitlines():
        for key, (name, label) in SERIES.items():
            if line.startswith(name) and label in line:
                sums[key] += float(line.rsplit(" ", 1)[1])
    return sums


def one(client: httpx.Client, url: str, item: dict[str, str], args) -> dict[str, float]:
    body = {
        "model": args.model,
        "messages": [{"role": "user", "content": item["instruction"] + "\n\n" + item["text"]}],
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
    }
    if args.prediction:
        body["prediction"] = {"type": "content", "content": item["text"]}
    before = spec_counters(client, url)
    t0 = time.perf_counter()
    r = client.post(url + "/v1/chat/completions", json=body)
    elapsed = time.perf_counter() - t0
    r.raise_for_status()
    after = spec_counters(client, url)
    d = {k: after[k] - before[k] for k in SERIES}
    return {
        "seconds": elapsed,
        "output_tokens": r.json()["usage"]["completion_tokens"],
        "acceptance": d["accepted"] / d["drafted"] if d["drafted"] else 0.0,
        "mean_accepted": d["accepted"] / d["rows"] if d["rows"] else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gapless bench edit", description=__doc__.split("\n")[0])
    p.add_argument("--target", action="append", required=True, help="NAME=URL, in turn")
    p.add_argument("--model", default=None, help="model name to send (default: the server's)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--prediction", action="store_true", help="send the block as `prediction`")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    targets = [t.split("=", 1) for t in args.target]
    prompts = load_prompts()[: args.num_prompts]
    rows: dict[str, list[dict[str, float]]] = {name: [] for name, _ in targets}
    with httpx.Client(timeout=600) as client:
        for i, item in enumerate(prompts):
            for name, url in targets:
                res = one(client, url, item, args)
                res["prompt"] = i
                rows[name].append(res)
                print(f"{name:>6} prompt {i:2d} ({item['kind']:5}): "
                      f"{res['output_tokens'] / res['seconds']:6.1f} tok/s, "
                      f"acceptance {res['acceptance']:.2f}, "
                      f"mean accepted {res['mean_accepted']:.2f}", flush=True)  # fmt: skip
    summary = {}
    for name, rs in rows.items():
        tokens, seconds = sum(r["output_tokens"] for r in rs), sum(r["seconds"] for r in rs)
        summary[name] = {"tok_s": tokens / seconds, "output_tokens": tokens, "seconds": seconds}
        print(f"{name}: {tokens} output tokens in {seconds:.1f} s: {tokens / seconds:.1f} tok/s")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
