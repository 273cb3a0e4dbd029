"""`python -m gapless.bench.hf_generate`: transformers' own generate on the default model's GGUF, the
baseline of bench/RESULTS.md. N prompts of IN random ids, OUT new tokens each, one batch, greedy,
EOS ignored; prints output tokens per second."""

import argparse
import random
import time

import torch
import transformers

from gapless.common.model_cache import default_model_path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num", type=int, default=32)
    p.add_argument("--inp", type=int, default=128)
    p.add_argument("--out", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    g = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(g.parent), gguf_file=g.name, torch_dtype=getattr(torch, a.dtype)
    ).eval()
    ids = torch.tensor(
        [[random.Random(i).randrange(100, 40000) for _ in range(a.inp)] for i in range(a.num)]
    )
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=a.out,
            min_new_tokens=a.out,
            do_sample=False,
            pad_token_id=0,
        )
        dt = time.perf_counter() - t0
    n = (out.shape[1] - a.inp) * a.num
    print(
        f"transformers generate: {a.num} x {a.inp}:{a.out} {a.dtype} threads={a.threads}: {dt:.2f}s, {n / dt:.1f} output tok/s"
    )


if __name__ == "__main__":
    main()
