"""Models of real shapes with random weights, for the GPU check: each family gapless serves,
its config.json as its Hugging Face checkpoint has it (a few keys beside the shapes left out),
written as a model directory gapless serves: config.json, one safetensors file of random bf16
weights, and a tokenizer (the default model's: its ids are the first rows of the vocabulary).

Embedding and LM-head rows past the tokenizer's vocabulary are zero, so the random model's
logits there are 0 against the random rows' spread: greedy picks ids the tokenizer decodes,
and the detokenizer does its usual work.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gapless.common import families
from gapless.common.families.base import ModelArch

INIT_STD = 0.02  # of every weight matrix; norms are 1 (Gemma's, stored as w in 1 + w, are 0)
SEED = 1234


@dataclass(frozen=True)
class Shape:
    name: str
    source: str  # the checkpoint whose config.json this is
    config: dict
    layers: int | None = None  # fewer layers than the checkpoint's, to fit the check's time
    why_layers: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def family(self) -> str:
        return families.read_config(self.config, self.name)[0].name

    def config_json(self, eos: int = 2, bos: int = 1) -> dict:
        """config.json as written: the checkpoint's, layers cut where asked, the tokenizer's
        BOS and EOS ids (the default model's tokenizer travels with every shape)."""
        out = {**self.config, "bos_token_id": bos, "eos_token_id": eos}
        if self.layers is not None:
            out["num_hidden_layers"] = self.layers
            if "layer_types" in out:
                out["layer_types"] = out["layer_types"][: self.layers]
        return out

    def arch(self) -> ModelArch:
        return families.arch_from_config(self.config_json(), self.name)


_LLAMA3 = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
               rms_norm_eps=1e-5, rope_theta=500000.0, vocab_size=128256, attention_bias=False,
               torch_dtype="bfloat16")  # fmt: skip
SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape(  # the default model's shape: the rehearsal on a cpu (run.py --rehearse)
            "smollm2-135m",
            "HuggingFaceTB/SmolLM2-135M",
            dict(
                _LLAMA3,
                hidden_size=576,
                intermediate_size=1536,
                num_hidden_layers=30,
                num_attention_heads=9,
                num_key_value_heads=3,
                vocab_size=49152,
                max_position_embeddings=8192,
                rope_theta=100000.0,
                tie_word_embeddings=True,
            ),
        ),  # fmt: skip
        Shape(
            "llama3-8b",
            "meta-llama/Meta-Llama-3-8B",
            dict(
                _LLAMA3,
                hidden_size=4096,
                intermediate_size=14336,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                max_position_embeddings=8192,
                tie_word_embeddings=False,
            ),
        ),  # fmt: skip
        Shape(
            "llama3.2-1b",
            "meta-llama/Llama-3.2-1B",
            dict(
                _LLAMA3,
                hidden_size=2048,
                intermediate_size=8192,
                num_hidden_layers=16,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=64,
                max_position_embeddings=131072,
                tie_word_embeddings=True,
                rope_scaling=dict(
                    rope_type="llama3",
                    factor=32.0,
                    high_freq_factor=4.0,
                    low_freq_factor=1.0,
                    original_max_position_embeddings=8192,
                ),
            ),
        ),  # fmt: skip
        Shape(
            "qwen3-0.6b",
            "Qwen/Qwen3-0.6B",
            dict(
                architectures=["Qwen3ForCausalLM"],
                model_type="qwen3",
                hidden_size=1024,
                intermediate_size=3072,
                num_hidden_layers=28,
                num_attention_heads=16,
                num_key_value_heads=8,
                head_dim=128,
                vocab_size=151936,
                max_position_embeddings=40960,
                rope_theta=1000000.0,
                rms_norm_eps=1e-6,
                hidden_act="silu",
                attention_bias=False,
                tie_word_embeddings=True,
                use_sliding_window=False,
                max_window_layers=28,
            ),
        ),  # fmt: skip
        Shape(
            "mixtral-8x7b",
            "mistralai/Mixtral-8x7B-v0.1",
            dict(
                architectures=["MixtralForCausalLM"],
                model_type="mixtral",
                hidden_size=4096,
                intermediate_size=14336,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                vocab_size=32000,
                max_position_embeddings=32768,
                rope_theta=1000000.0,
                rms_norm_eps=1e-5,
                hidden_act="silu",
                num_local_experts=8,
                num_experts_per_tok=2,
                sliding_window=None,
                tie_word_embeddings=False,
            ),
            layers=2,
            why_layers="47B parameters (94 GB in bf16) fit neither the card nor the time",
        ),  # fmt: skip
        Shape(
            "qwen1.5-moe-a2.7b",
            "Qwen/Qwen1.5-MoE-A2.7B",
            dict(
                architectures=["Qwen2MoeForCausalLM"],
                model_type="qwen2_moe",
                hidden_size=2048,
                intermediate_size=5632,
                moe_intermediate_size=1408,
                shared_expert_intermediate_size=5632,
                num_experts=60,
                num_experts_per_tok=4,
                norm_topk_prob=False,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                num_hidden_layers=24,
                num_attention_heads=16,
                num_key_value_heads=16,
                vocab_size=151936,
                max_position_embeddings=8192,
                rope_theta=1000000.0,
                rms_norm_eps=1e-6,
                hidden_act="silu",
                use_sliding_window=False,
                max_window_layers=21,
                tie_word_embeddings=False,
            ),
            layers=4,
            why_layers="14.3B parameters: 28 GB to write and load, four times over",
        ),  # fmt: skip
        Shape(
            "qwen3-30b-a3b",
            "Qwen/Qwen3-30B-A3B",
            dict(
                architectures=["Qwen3MoeForCausalLM"],
                model_type="qwen3_moe",
                hidden_size=2048,
                intermediate_size=6144,
                moe_intermediate_size=768,
                num_experts=128,
                num_experts_per_tok=8,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                num_hidden_layers=48,
                num_attention_heads=32,
                num_key_value_heads=4,
                head_dim=128,
                vocab_size=151936,
                max_position_embeddings=40960,
                rope_theta=1000000.0,
                rms_norm_eps=1e-6,
                hidden_act="silu",
                attention_bias=False,
                use_sliding_window=False,
                tie_word_embeddings=False,
            ),
            layers=4,
            why_layers="30.5B parameters (61 GB in bf16) fit neither the time nor an H100 twice",
        ),  # fmt: skip
        Shape(
            "qwen2.5-0.5b",
            "Qwen/Qwen2.5-0.5B",
            dict(
                architectures=["Qwen2ForCausalLM"],
                model_type="qwen2",
                hidden_size=896,
                intermediate_size=4864,
                num_hidden_layers=24,
                num_attention_heads=14,
                num_key_value_heads=2,
                vocab_size=151936,
                max_position_embeddings=32768,
                rope_theta=1000000.0,
                rms_norm_eps=1e-6,
                hidden_act="silu",
                use_sliding_window=False,
                sliding_window=32768,
                max_window_layers=24,
                tie_word_embeddings=True,
            ),
        ),  # fmt: skip
        Shape(
            "mistral-7b",
            "mistralai/Mistral-7B-v0.1",
            dict(
                architectures=["MistralForCausalLM"],
                model_type="mistral",
                hidden_size=4096,
                intermediate_size=14336,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                vocab_size=32000,
                max_position_embeddings=32768,
                rope_theta=10000.0,
                rms_norm_eps=1e-5,
                hidden_act="silu",
                sliding_window=4096,
                tie_word_embeddings=False,
            ),
            layers=8,
            why_layers="Llama-3-8B's layers already run full depth; the window is what is new",
        ),  # fmt: skip
        Shape(
            "phi3-mini",
            "microsoft/Phi-3-mini-4k-instruct",
            dict(
                architectures=["Phi3ForCausalLM"],
                model_type="phi3",
                hidden_size=3072,
                intermediate_size=8192,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=32,
                vocab_size=32064,
                max_position_embeddings=4096,
                original_max_position_embeddings=4096,
                rope_theta=10000.0,
                rms_norm_eps=1e-5,
                hidden_act="silu",
                sliding_window=2047,
                rope_scaling=None,
                tie_word_embeddings=False,
            ),
            layers=16,
            why_layers="3.8B parameters; half the depth halves its write and load",
        ),  # fmt: skip
        Shape(
            "gemma3-1b",
            "google/gemma-3-1b-it",
            dict(
                architectures=["Gemma3ForCausalLM"],
                model_type="gemma3_text",
                hidden_size=1152,
                intermediate_size=6912,
                num_hidden_layers=26,
                num_attention_heads=4,
                num_key_value_heads=1,
                head_dim=256,
                vocab_size=262144,
                max_position_embeddings=32768,
                rope_theta=1000000.0,
                rope_local_base_freq=10000.0,
                sliding_window=512,
                sliding_window_pattern=6,
                query_pre_attn_scalar=256,
                rms_norm_eps=1e-6,
                hidden_activation="gelu_pytorch_tanh",
                final_logit_softcapping=None,
                attn_logit_softcapping=None,
                tie_word_embeddings=True,
            ),
        ),  # fmt: skip
        Shape(
            "gemma2-2b",
            "google/gemma-2-2b",
            dict(
                architectures=["Gemma2ForCausalLM"],
                model_type="gemma2",
                hidden_size=2304,
                intermediate_size=9216,
                num_hidden_layers=26,
                num_attention_heads=8,
                num_key_value_heads=4,
                head_dim=256,
                vocab_size=256000,
                max_position_embeddings=8192,
                rope_theta=10000.0,
                query_pre_attn_scalar=256,
                sliding_window=4096,
                attn_logit_softcapping=50.0,
                final_logit_softcapping=30.0,
                rms_norm_eps=1e-6,
                hidden_activation="gelu_pytorch_tanh",
                tie_word_embeddings=True,
            ),
        ),  # fmt: skip
    )
}


def param_shape(name: str, arch: ModelArch) -> tuple[int, ...]:
    """The shape of one parameter (Hugging Face name, as gpu_runner/model/weights.py lists them)."""
    h, d, v = arch.hidden_size, arch.head_dim, arch.vocab_size
    q, kv = arch.num_heads * d, arch.num_kv_heads * d
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (v, h)
    if name.endswith(("norm.weight", "layernorm.weight")):
        return (d,) if name.endswith(("q_norm.weight", "k_norm.weight")) else (h,)
    stem, _, leaf = name.rpartition(".")  # "model.layers.0.self_attn.q_proj", "weight"
    kind = stem.rpartition(".")[2]
    if ".self_attn." in name:
        rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "qkv_proj": q + 2 * kv, "o_proj": h}
        if leaf == "bias":
            return (rows[kind],)
        return (h, q) if kind == "o_proj" else (rows[kind], h)
    if name.endswith("mlp.gate.weight"):  # the router
        return (arch.num_experts, h)
    if name.endswith("shared_expert_gate.weight"):
        return (1, h)
    if ".experts." in name:
        size = arch.moe_intermediate_size
    elif ".shared_expert." in name:
        size = arch.shared_expert_intermediate_size
    else:
        size = arch.intermediate_size
    rows = {"gate_proj": size, "up_proj": size, "gate_up_proj": 2 * size}
    return (h, size) if kind == "down_proj" else (rows[kind], h)


def parameters(arch: ModelArch) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter the loader reads for this architecture."""
    from gapless.gpu_runner.model.weights import parameter_names

    fused = families.family(arch.architecture).fused
    return [(n, param_shape(n, arch)) for n in parameter_names(arch, fused)]


class Values:
    """Random bf16 weights, written fast: one seeded draw of PERIOD normal values, streamed over
    and over from where the last tensor stopped. The period is a prime longer than any row,
    so no two rows of a matrix hold the same values."""

    PERIOD = 4_194_301  # prime

    def __init__(self, arch: ModelArch, vocab: int, seed: int = SEED) -> None:
        import torch

        gen = torch.Generator().manual_seed(seed)
        draw = torch.randn(self.PERIOD, generator=gen).mul_(INIT_STD).to(torch.bfloat16)
        # two periods, as bytes: any window of up to one period is one contiguous slice
        self.ring = torch.cat([draw, draw]).view(torch.uint8).numpy()
        self.zeros = bytes(2 * self.PERIOD)
        self.arch, self.vocab, self.offset = arch, vocab, 0

    def __call__(self, name: str, shape: tuple[int, ...]):
        """The tensor's bytes, in parts (a small tensor whole)."""
        import torch

        if name.endswith("norm.weight"):
            fill = 0.0 if self.arch.norm_offset else 1.0  # Gemma's scale is 1 + w
            return torch.full(shape, fill, dtype=torch.bfloat16)
        if name.endswith(".bias"):
            return torch.zeros(shape, dtype=torch.bfloat16)
        return self._parts(name, shape)

    def _parts(self, name: str, shape: tuple[int, ...]):
        n = math.prod(shape)
        kept = n
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            kept = min(self.vocab, shape[0]) * shape[1]  # rows the tokenizer has text for
        while kept:
            start, count = self.offset % self.PERIOD, min(kept, self.PERIOD)
            yield self.ring[2 * start : 2 * (start + count)]
            self.offset, kept, n = self.offset + count, kept - count, n - count
        while n:  # ids the tokenizer has no text for: zero rows, never the argmax
            count = min(n, self.PERIOD)
            yield self.zeros[: 2 * count]
            n -= count


def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...]]], make) -> int:
    """A safetensors file of bf16 tensors, each made by make(name, shape) when its turn comes
    (a tensor, or its bytes in parts): one in memory at a time; the file's size in bytes."""
    import torch

    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        size = 2 * math.prod(shape)
        header[name] = {
            "dtype": "BF16",
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, shape in tensors:
            made = make(name, shape)
            if isinstance(made, torch.Tensor):
                assert tuple(made.shape) == shape, f"{name}: {tuple(made.shape)} is not {shape}"
                flat = made.to(torch.bfloat16).contiguous().cpu().view(-1)
                made = [flat.view(torch.uint8).numpy()]
            written = sum(f.write(part) for part in made)
            assert written == 2 * math.prod(shape), f"{name}: {written} bytes is not {shape}"
    return 8 + len(text) + offset


def write_model(shape: Shape, out: Path, tokenizer_gguf: Path) -> Path:
    """The model directory of `shape` in `out`: config.json, model.safetensors (random),
    tokenizer.json and tokenizer_config.json of the GGUF's tokenizer."""

    from gapless.common.model_files import load_tokenizer, resolve_model

    out.mkdir(parents=True, exist_ok=True)
    info = resolve_model(str(tokenizer_gguf))
    tokenizer = load_tokenizer(info)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    eos = info.eos_token_ids[0]
    config = shape.config_json(eos=eos, bos=info.bos_token_id if info.bos_token_id else 1)
    arch = families.arch_from_config(config, shape.name)
    assert arch.vocab_size >= vocab, f"{shape.name}: a vocabulary smaller than the tokenizer's"
    write_safetensors(out / "model.safetensors", parameters(arch), Values(arch, vocab))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer.save(str(out / "tokenizer.json"))
    tok_config = {
        "chat_template": info.chat_template,
        "bos_token": tokenizer.id_to_token(info.bos_token_id) if info.bos_token_id else None,
        "eos_token": tokenizer.id_to_token(eos),
        "add_bos_token": info.add_bos_token,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1))
    return out


def weight_bytes(arch: ModelArch) -> int:
    """bf16 bytes of the model's safetensors file (without its header)."""
    return sum(2 * math.prod(s) for _, s in parameters(arch))


def iter_shapes(names: list[str] | None = None) -> Iterator[Shape]:
    for name in names or list(SHAPES):
        if name not in SHAPES:
            raise ValueError(f"unknown shape {name!r} (known: {', '.join(SHAPES)})")
        yield SHAPES[name]
