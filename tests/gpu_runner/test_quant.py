"""Weight-only int8 / int4 linear layers: torch's kernels, GGUF's Q4_1 kept exactly, quality."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gapless.bench.cpu_step import Streams, runner_config
from gapless.bench.perplexity import perplexity
from gapless.core.common.model_files import load_arch, load_tokenizer, resolve_model
from gapless.gpu_runner.quant import (
    DENSE_ROWS,
    KERNEL_DTYPE,
    Int8Linear,
    int4_groups,
    int8_rows,
    make_int4,
    q4_1_blocks,
)
from gapless.gpu_runner.weights import load_weights


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """t rounded to bfloat16, the quantized kernels' dtype, back in float32."""
    return t.to(KERNEL_DTYPE).float()


@pytest.mark.parametrize("rows", [5, DENSE_ROWS + 1], ids=["kernel", "widened"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_is_the_per_row_dequantized_product(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(0)
    w, x, b = (
        torch.randn(96, 64, generator=gen),
        torch.randn(rows, 64, generator=gen),
        torch.randn(96),
    )
    q, scale = int8_rows(w)
    assert (w - q.float() * scale[:, None]).abs().max() <= scale.max() / 2 + 1e-6
    got = Int8Linear(q, scale.to(KERNEL_DTYPE), b.to(dtype))(x.to(dtype))
    assert got.dtype == dtype, "the activations keep their dtype around the kernel"
    want = F.linear(_bf16(x), q.float() * _bf16(scale)[:, None], b)
    assert torch.allclose(got.float(), want, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_is_the_group_dequantized_product(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(64, 128, generator=gen), torch.randn(3, 2, 128, generator=gen)
    q, d, m = int4_groups(w)
    deq = (q.float().view(64, 4, 32) * d[..., None] + m[..., None]).view(64, 128)
    assert (w - deq).abs().max() <= d.max() / 2 + 1e-5
    got = make_int4(q, d, m, None)(x.to(dtype))
    assert got.dtype == dtype and got.shape == (3, 2, 64)
    # the kernel's form: (q - 8) * scale + zero, scale and zero in bfloat16
    zero = _bf16(m + 8 * d)
    kernel_w = (q.float().view(64, 4, 32) - 8) * _bf16(d)[..., None] + zero[..., None]
    want = F.linear(_bf16(x), kernel_w.view(64, 128))
    assert torch.allclose(got.float(), want, rtol=2e-2, atol=5e-2)


@pytest.mark.slow
def test_q4_1_blocks_hold_the_files_weights_exactly(default_gguf) -> None:
    info = resolve_model(str(default_gguf))
    arch = load_arch(info)
    blocks = q4_1_blocks(default_gguf, arch)
    assert len(blocks) == 7 * arch.num_layers
    weights = load_weights(info, arch, torch.float32)
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.7.self_attn.k_proj",
                 "model.layers.29.mlp.down_proj"):  # fmt: skip
        q, d, m = blocks[name]
        n, k = q.shape
        deq = (q.float().view(n, k // 32, 32) * d[..., None] + m[..., None]).view(n, k)
        assert torch.equal(deq, weights[name + ".weight"])


SMALL = ["--max-num-seqs", "1", "--kv-cache-memory", "16MiB", "--threads", "2"]


@pytest.mark.slow
def test_quantized_formats_keep_perplexity_within_2_percent_and_say_paris(default_gguf) -> None:
    from gapless.gpu_runner.runner import ModelRunner

    text = (
        "The river town woke slowly on market days. Before the sun cleared the hills, the "
        "bakers had already lit their ovens, and the smell of bread drifted down the narrow "
        "streets toward the water. Fishermen pulled their boats onto the gravel."
    )
    ppl = {}
    # int4 decodes through the compiled step (bf16 activations), the others eagerly; int8 under
    # float32 activations, which convert at the quantized layers' edges
    for dtype, quant, compile in (
        ("float32", "none", ["--no-compile"]),
        ("float32", "int8", ["--no-compile"]),
        ("bfloat16", "int4", []),
    ):
        args = [
            "--model", str(default_gguf), *SMALL, "--dtype", dtype, "--quantization", quant,
            *compile,
        ]  # fmt: skip
        runner = ModelRunner(runner_config(args, 1, 256))
        tok = load_tokenizer(runner.config.model)
        ppl[quant] = perplexity(runner, tok.encode(text).ids)
        prompt = tok.encode(
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        ).ids
        streams = Streams(runner, 1, len(prompt), 12)
        ids = streams.prefill([prompt]) + [streams.decode()[0] for _ in range(10)]
        assert "Paris" in tok.decode(ids), (quant, tok.decode(ids))
    assert 1.0 < ppl["none"] < 200.0
    for quant in ("int8", "int4"):
        assert abs(ppl[quant] / ppl["none"] - 1) < 0.02, ppl
    assert ppl["int4"] != ppl["none"]  # the quantized path ran
