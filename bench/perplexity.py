"""Perplexity of the served model on a fixed text, through the cpu runner's own forward.

python -m gapless.bench.perplexity                          # every weight format, fp32 first
python -m gapless.bench.perplexity --formats int4 -- --dtype bfloat16
python -m gapless.bench.perplexity --decode                 # through decode steps, as served

Each format is one runner built from `gapless serve` flags (after `--`) plus --dtype and
--quantization; the text is one prompt, and every position's next-token log-likelihood counts.
With --decode the text goes through one decode step per token instead, as one stream is served:
the compiled step, and the weights and kernels of a one-row step (int4-dual's int4 layers and
int8 output layer, which a prompt's many rows never reach).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import msgspec
import torch

from gapless.bench.cpu_step import Streams, runner_config
from gapless.bench.floor import FORMATS  # (dtype, quantization); fp32 is the reference
from gapless.gpu_runner.batch import LOGIT_ROWS

TEXT = Path(__file__).parent / "data" / "perplexity.txt"


def text_ids(runner, path: Path = TEXT) -> list[int]:
    from gapless.common.model_files import load_tokenizer

    return load_tokenizer(runner.config.model).encode(path.read_text()).ids


@torch.inference_mode()
def perplexity(runner, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ids[1:], each given the ids before it."""
    streams = Streams(runner, 1, len(ids), 0)
    plan = streams.plan(True, [ids])
    runner.begin(plan)
    inp, meta = runner.prepare(plan)
    num = inp.num_rows
    runner.batch.table[:num, LOGIT_ROWS] = torch.arange(num)  # every row's logits
    logits = runner.forward(num, meta, num)  # [T, vocab] float32
    target = torch.tensor(ids[1:])
    nll = torch.nn.functional.cross_entropy(logits[:-1].double(), target)
    _free(runner, plan)
    return math.exp(float(nll))


def _free(runner, plan) -> None:
    """Free the text's slot after its last plan, so the runner takes another text."""
    runner.begin(msgspec.structs.replace(plan, seq=plan.seq + 1, new_slots=[], freed_slots=[0],
                                         slots=[], num_tokens=[], start_pos=[], has_tokens=[],
                                         token_ids=[], sample=[], num_new_blocks=[],
                                         new_blocks=[]))  # fmt: skip
    runner.batch.num_blocks[:] = 0


@torch.inference_mode()
def decode_perplexity(runner, ids: list[int]) -> float:
    """perplexity(), each token fed by a decode step of its own (a one-row step)."""
    streams = Streams(runner, 1, len(ids), 0)
    nll = 0.0
    for i, tok in enumerate(ids[:-1]):
        plan = streams.plan(i == 0, [[tok]])
        runner.begin(plan)
        inp, meta = runner.prepare(plan)
        logits = runner.run_model(inp, meta)[0].double()  # the row's next-token logits
        nll -= float(logits.log_softmax(-1)[ids[i + 1]])
    _free(runner, plan)
    return math.exp(nll / (len(ids) - 1))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(prog="python -m gapless.bench.perplexity")
    p.add_argument("--formats", nargs="+", choices=list(FORMATS), default=list(FORMATS))
    p.add_argument("--text", type=Path, default=TEXT)
    p.add_argument("--decode", action="store_true", help="one decode step per token (see above)")
    args = p.parse_args(argv[:split])
    from gapless.gpu_runner.cpu.backend import CpuBackend

    reference = None
    for name in args.formats:
        dtype, quant = FORMATS[name]
        serve = [*argv[split + 1 :], "--dtype", dtype, "--quantization", quant]
        start = time.perf_counter()
        runner = CpuBackend(runner_config(serve, 1, 4096)).executor
        ids = text_ids(runner, args.text)
        ppl = (decode_perplexity if args.decode else perplexity)(runner, ids)
        reference = reference or ppl
        print(f"{name:>10}: perplexity {ppl:8.4f}  ({ppl / reference - 1:+.2%} of {args.formats[0]})"
              f"  {len(ids)} tokens, {time.perf_counter() - start:.1f} s", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
