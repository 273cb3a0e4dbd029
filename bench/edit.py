"""`gapless bench edit`: the edit workload for speculative decoding.

Sixteen prompts committed in bench/data/edit_prompts.json, half code and half prose, each a
block of about 400 tokens and an instruction to rewrite it with one change. Each prompt goes to
every target in turn (on, off, on, off, ...: alternation, so a drift of the machine hits both),
as a chat completion at temperature 0; `--streams N` sends N prompts at once to a target, then
the same N to the next. `--prediction` sends the block as OpenAI's `prediction`;
`--predict-output URL` first asks URL for the prompt without a prediction (reported as target
`off`), then sends that output, with `--change-lines` of its lines changed, as each target's
prediction. Reported per target: output tokens per second (output tokens only, over the wall
time of the requests, or of each group of N at once), and at one stream the decode rate (the
tokens after the first over the time after it, streamed); per prompt: the acceptance rate (accepted /
drafted tokens) and the mean accepted length (accepted drafts per verifying step), read from a
gapless target's /metrics around the request, or from llama-server's `timings` in its answer.

    python -m gapless.bench.cli edit --target on=http://127.0.0.1:8001 \\
        --target off=http://127.0.0.1:8002 --max-tokens 256
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
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


def change_lines(text: str, fraction: float, seed: int) -> str:
    """text with round(fraction x its non-blank lines) of them changed: each chosen line's words
    in reverse order (a line of one word gets a word added), the rest as they were."""
    if fraction <= 0:
        return text
    lines = text.split("\n")
    full = [i for i, line in enumerate(lines) if line.strip()]
    count = max(1, round(fraction * len(full))) if full else 0
    for i in random.Random(seed).sample(full, count):
        words = lines[i].split()
        indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
        lines[i] = indent + " ".join(words[::-1] if len(words) > 1 else [*words, "again"])
    return "\n".join(lines)


def spec_counters(client: httpx.Client, url: str) -> dict[str, float]:
    """Drafted and accepted tokens and verifying rows so far, summed over labels; zeros for a
    server without gapless's series."""
    sums = dict.fromkeys(SERIES, 0.0)
    r = client.get(url + "/metrics")
    if r.status_code != 200:
        return sums
    for line in r.text.splitlines():
        for key, (name, label) in SERIES.items():
            if line.startswith(name) and label in line:
                sums[key] += float(line.rsplit(" ", 1)[1])
    return sums


def request(client: httpx.Client, url: str, item: dict, args, prediction: str | None) -> dict:
    body = {
        "model": args.model,
        "messages": [{"role": "user", "content": item["instruction"] + "\n\n" + item["text"]}],
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
    }
    if prediction is not None:
        body["prediction"] = {"type": "content", "content": prediction}
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    first, text, usage, timings = None, [], None, {}
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings  # llama-server's, with its drafts
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = time.perf_counter() if first is None else first
                    text.append(piece)
    elapsed = time.perf_counter() - t0
    assert usage is not None, f"{url} sent no usage"
    return {
        "seconds": elapsed,
        "ttft": (first or t0 + elapsed) - t0,
        "output_tokens": usage["completion_tokens"],
        "text": "".join(text),
        "drafted": float(timings.get("draft_n", 0)),
        "accepted": float(timings.get("draft_n_accepted", 0)),
    }


def group(client, pool, url: str, items: list[tuple[int, dict]], args, predictions) -> list[dict]:
    """items sent at once to url; each result with its prompt and the counters' change."""
    before = spec_counters(client, url)
    t0 = time.perf_counter()
    futures = [
        pool.submit(request, client, url, item, args, predictions.get(i)) for i, item in items
    ]
    results = [f.result() for f in futures]
    wall = time.perf_counter() - t0
    after = spec_counters(client, url)
    d = {k: after[k] - before[k] for k in SERIES}
    if not d["drafted"]:  # not gapless: the answers' own counts, if any
        d["drafted"] = sum(r["drafted"] for r in results)
        d["accepted"] = sum(r["accepted"] for r in results)
    for (i, _), res in zip(items, results, strict=True):
        res["prompt"] = i
        res["group_seconds"] = wall
        res["acceptance"] = d["accepted"] / d["drafted"] if d["drafted"] else 0.0
        res["mean_accepted"] = d["accepted"] / d["rows"] if d["rows"] else 0.0
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gapless bench edit", description=__doc__.split("\n")[0])
    p.add_argument("--target", action="append", required=True, help="NAME=URL, in turn")
    p.add_argument("--model", default=None, help="model name to send (default: the server's)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--prediction", action="store_true", help="send the block as `prediction`")
    p.add_argument(
        "--predict-output",
        default=None,
        metavar="URL",
        help="send as `prediction` URL's own output for the prompt (asked first, as target off)",
    )
    p.add_argument(
        "--change-lines",
        type=float,
        default=0.0,
        help="with --predict-output: the fraction of the output's lines changed (e.g. 0.1)",
    )
    p.add_argument("--streams", type=int, default=1, help="prompts sent at once to a target")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    if args.streams < 1:
        p.error("--streams must be at least 1")
    targets = [t.split("=", 1) for t in args.target]
    if args.predict_output:
        targets = [["off", args.predict_output], *targets]
    prompts = list(enumerate(load_prompts()[: args.num_prompts]))
    groups = [prompts[i : i + args.streams] for i in range(0, len(prompts), args.streams)]
    rows: dict[str, list[dict]] = {name: [] for name, _ in targets}
    # why no kept-alive connections: llama-server closes idle ones, and a request sent on one
    # it closed fails
    limits = httpx.Limits(max_keepalive_connections=0)
    with (
        httpx.Client(timeout=600, limits=limits) as client,
        ThreadPoolExecutor(args.streams) as pool,
    ):
        for items in groups:
            predictions: dict[int, str] = {}
            if args.prediction:
                predictions = {i: item["text"] for i, item in items}
            for name, url in targets:
                own = {} if (args.predict_output and name == "off") else predictions
                results = group(client, pool, url, items, args, own)
                if args.predict_output and name == "off":
                    predictions = {
                        r["prompt"]: change_lines(r["text"], args.change_lines, r["prompt"])
                        for r in results
                    }
                for res in results:
                    rows[name].append(res)
                    kind = prompts[res["prompt"]][1]["kind"]
                    rate = res["output_tokens"] / res["seconds"]
                    print(f"{name:>6} prompt {res['prompt']:2d} ({kind:5}): {rate:6.1f} tok/s, "
                          f"ttft {res['ttft']:.2f} s, acceptance {res['acceptance']:.2f}, "
                          f"mean accepted {res['mean_accepted']:.2f}", flush=True)  # fmt: skip
    summary = {}
    for name, rs in rows.items():
        tokens = sum(r["output_tokens"] for r in rs)
        # a group's wall time once: the requests sent together overlap
        seconds = sum(rs[i]["group_seconds"] for i in range(0, len(rs), args.streams))
        # decode: the tokens after each first one over the time after it (one stream only)
        decode = sum(r["output_tokens"] - 1 for r in rs) / sum(r["seconds"] - r["ttft"] for r in rs)
        summary[name] = {"tok_s": tokens / seconds, "decode_tok_s": decode,
                         "output_tokens": tokens, "seconds": seconds}  # fmt: skip
        print(f"{name}: {tokens} output tokens in {seconds:.1f} s: {tokens / seconds:.1f} tok/s"
              + (f"; decode {decode:.1f} tok/s" if args.streams == 1 else ""))  # fmt: skip
    base = "off" if "off" in summary else next(iter(summary))
    for name in summary:
        if name != base:
            ratio = summary[name]["tok_s"] / summary[base]["tok_s"]
            line = f"{name} / {base}: {ratio:.2f}x output tok/s"
            if args.streams == 1:
                d = summary[name]["decode_tok_s"] / summary[base]["decode_tok_s"]
                line += f", {d:.2f}x decode tok/s"
            print(line)
    if args.output_json:
        for rs in rows.values():
            for r in rs:
                r.pop("text")
        Path(args.output_json).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
