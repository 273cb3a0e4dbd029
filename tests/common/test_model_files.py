from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gapless.common.config import ModelInfo
from gapless.common.model_files import load_arch, load_tokenizer, read_gguf, resolve_model

TEXTS = [
    "Hello, world!",
    "The capital of France is Paris.",
    "123 4567 89,000.5 and x=3.14159",
    " 12 apples",
    "日本語 café naïve ÀÉÎÕÜ ß ∑∫√",
    "emoji 😀🤖🚀 family 👨‍👩‍👧",
    "def f(x):\n    return x**2  # square\n\n\n",
    "   leading and trailing   ",
    "\t\ttabs\r\nCRLF\n\n  \n",
    "I'm sure they've said we'll go, can't they?",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><file_sep>x<repo_name>",
    "",
    " ",
    "a" * 50,
]


@pytest.fixture(scope="session")
def gguf_info(default_gguf: Path) -> ModelInfo:
    return resolve_model(str(default_gguf))


@pytest.fixture(scope="session")
def gguf_tokenizer(gguf_info: ModelInfo):
    return load_tokenizer(gguf_info)


@pytest.fixture(scope="session")
def reference_tokenizer(default_gguf: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        str(default_gguf.parent), gguf_file=default_gguf.name
    )


def test_resolve_gguf_facts(gguf_info: ModelInfo, default_gguf: Path) -> None:
    assert gguf_info.path == str(default_gguf)
    assert gguf_info.architecture == "llama"
    assert gguf_info.vocab_size == 49152
    assert gguf_info.max_model_len == 8192
    assert gguf_info.eos_token_ids == (2,)
    assert gguf_info.bos_token_id == 1
    assert gguf_info.add_bos_token is False
    assert gguf_info.chat_template and "<|im_start|>" in gguf_info.chat_template


def test_resolve_none_is_default_and_cap(default_gguf: Path) -> None:
    info = resolve_model(None, max_model_len=1024)
    assert info.path == str(default_gguf)
    assert info.max_model_len == 1024
    assert resolve_model(str(default_gguf), max_model_len=10**6).max_model_len == 8192


def test_read_gguf_header(default_gguf: Path) -> None:
    gguf = read_gguf(default_gguf)
    assert len(gguf.tensors) == 272
    assert "output.weight" not in gguf.tensors
    assert gguf.tensors["blk.0.ffn_gate.weight"].shape == (1536, 576)  # [out, in]
    assert len(gguf.metadata["tokenizer.ggml.merges"]) == 48900
    assert gguf.metadata["tokenizer.ggml.pre"] == "smollm"


def test_load_arch_gguf(gguf_info: ModelInfo) -> None:
    arch = load_arch(gguf_info)
    assert (arch.num_layers, arch.hidden_size, arch.intermediate_size) == (30, 576, 1536)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (9, 3, 64)
    assert (arch.vocab_size, arch.max_position) == (49152, 8192)
    assert arch.rope_theta == 100000.0
    assert arch.rms_norm_eps == 1e-5
    assert arch.tie_word_embeddings and not arch.attention_bias and arch.rope_scaling is None


def test_bench_tokenizer_build(benchmark, gguf_info: ModelInfo) -> None:
    """How long the tokenizer takes to build from the GGUF's metadata (`make bench`)."""
    tokenizer = benchmark(load_tokenizer, gguf_info)
    assert tokenizer.get_vocab_size() == 49152


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_matches_transformers(gguf_tokenizer, reference_tokenizer, text) -> None:
    ids = gguf_tokenizer.encode(text, add_special_tokens=False).ids
    assert ids == reference_tokenizer.encode(text, add_special_tokens=False)
    for skip in (False, True):
        assert gguf_tokenizer.decode(ids, skip_special_tokens=skip) == reference_tokenizer.decode(
            ids, skip_special_tokens=skip
        )


def test_special_tokens_are_single_ids(gguf_tokenizer) -> None:
    for text, token_id in [("<|endoftext|>", 0), ("<|im_start|>", 1), ("<|im_end|>", 2)]:
        assert gguf_tokenizer.encode(text, add_special_tokens=False).ids == [token_id]
    ids = gguf_tokenizer.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False).ids
    assert ids[0] == 1 and ids[-1] == 2
    assert gguf_tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert gguf_tokenizer.encode("1234").tokens == ["1", "2", "3", "4"]  # smollm splits digits


def _write_sentencepiece_gguf(path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    pieces = ["▁", "e", "t", "a", "o", "h", "l", "r", "s", "n", "i", "d", "w", "▁t", "he", "▁the"]
    pieces += ["▁a", "ll", "▁w", "or", "▁wor", "ld", "▁world", "el", "lo", "▁h", "▁he", "▁hel"]
    pieces += ["▁hell", "▁hello", "in", "▁in", "ing", "▁th", "é", "▁é", "x", "!", ",", "▁▁"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_context_length(128)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_sentencepiece_gguf_tokenizer_matches_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    _write_sentencepiece_gguf(tmp_path / "spm.gguf")
    info = resolve_model(str(tmp_path / "spm.gguf"))
    assert info.add_bos_token is True  # llama.cpp's default for sentencepiece
    assert (info.bos_token_id, info.eos_token_ids, info.vocab_size) == (1, (2,), 299)
    ours = load_tokenizer(info)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    texts = ["hello world", " hello", "  hello  world ", "hello\nthe", "héllo wörld! 😀", "x", ""]
    for text in texts + ["<s>hello</s> the", "ending in the, done"]:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids), text


# --- Hugging Face directories -------------------------------------------------------------------

CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory, gguf_tokenizer) -> Path:
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("tiny-llama")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=49152,
        bos_token_id=1,
        eos_token_id=2,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    gguf_tokenizer.save(str(path / "tokenizer.json"))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok_config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHATML}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return path


def test_resolve_hf_dir(tiny_hf_dir: Path) -> None:
    info = resolve_model(str(tiny_hf_dir))
    assert info.architecture == "llama"
    assert (info.vocab_size, info.max_model_len) == (49152, 2048)
    assert info.eos_token_ids == (2, 0)  # config.json, then generation_config.json
    assert (info.bos_token_id, info.add_bos_token) == (1, False)
    assert info.chat_template == CHATML
    assert resolve_model(str(tiny_hf_dir), max_model_len=100).max_model_len == 100


def test_load_arch_hf(tiny_hf_dir: Path) -> None:
    arch = load_arch(resolve_model(str(tiny_hf_dir)))
    assert (arch.num_layers, arch.hidden_size, arch.intermediate_size) == (2, 64, 128)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (4, 2, 16)
    assert arch.rope_theta == 10000.0 and arch.rms_norm_eps == 1e-6
    assert not arch.tie_word_embeddings and not arch.attention_bias


def test_hf_tokenizer_and_template_file(tiny_hf_dir: Path, tmp_path: Path, gguf_tokenizer) -> None:
    tok = load_tokenizer(resolve_model(str(tiny_hf_dir)))
    for text in TEXTS:
        assert tok.encode(text).ids == gguf_tokenizer.encode(text).ids
    copy = tmp_path / "copy"
    copy.mkdir()
    for file in tiny_hf_dir.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    (copy / "chat_template.jinja").write_text("{{ messages }}")
    assert resolve_model(str(copy)).chat_template == "{{ messages }}"


def _config_dir(tmp_path: Path, **config) -> ModelInfo:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return ModelInfo(path=str(tmp_path), architecture=config["model_type"], vocab_size=10,
                     max_model_len=10, eos_token_ids=())  # fmt: skip


def test_qwen2_and_llama3_rope(tmp_path: Path) -> None:
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=10,
                 num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    arch = load_arch(_config_dir(tmp_path, model_type="qwen2", rope_theta=1e6, **shape))
    assert arch.architecture == "qwen2" and arch.attention_bias and arch.rope_theta == 1e6
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)  # fmt: skip
    arch = load_arch(_config_dir(tmp_path, model_type="llama", rope_scaling=scaling, **shape))
    assert arch.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    with pytest.raises(NotImplementedError, match="'ntk-parts' is not supported"):
        bad = {"type": "ntk-parts", "factor": 2.0}
        load_arch(_config_dir(tmp_path, model_type="llama", rope_scaling=bad, **shape))


def test_errors(tmp_path: Path, tiny_hf_dir: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8}))
    with pytest.raises(ValueError, match="no tokenizer.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text((tiny_hf_dir / "tokenizer.json").read_text())
    with pytest.raises(ValueError, match="safetensors"):
        resolve_model(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes((tiny_hf_dir / "model.safetensors").read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 8}))
    with pytest.raises(ValueError, match="'gpt2' is not supported"):
        resolve_model(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="neither"):
        resolve_model(str(tmp_path / "weights.bin"))
    (tmp_path / "bad.gguf").write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="not a GGUF"):
        resolve_model(str(tmp_path / "bad.gguf"))


# config.json as the Hub's checkpoints write it (transformers 4 keys), shapes shrunk
HUB = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, vocab_size=10,
           num_attention_heads=4, num_key_value_heads=2)  # fmt: skip


def _hub_arch(tmp_path: Path, **config):
    return load_arch(_config_dir(tmp_path, **{**HUB, **config}))


def test_hub_configs_of_every_family(tmp_path: Path) -> None:
    arch = _hub_arch(tmp_path, model_type="mistral", sliding_window=4096)
    assert arch.sliding_window == 4096 and arch.sliding_layers == (0, 1, 2, 3)
    assert _hub_arch(tmp_path, model_type="mistral", sliding_window=None).sliding_window == 0
    arch = _hub_arch(tmp_path, model_type="qwen3", use_sliding_window=False, sliding_window=4096,
                     max_window_layers=28, attention_bias=False, head_dim=32)  # fmt: skip
    assert arch.qk_norm and not arch.attention_bias and arch.head_dim == 32
    assert arch.sliding_window == 0  # use_sliding_window is off
    arch = _hub_arch(tmp_path, model_type="qwen2", use_sliding_window=True, sliding_window=8,
                     max_window_layers=2)  # fmt: skip
    assert arch.attention_bias and not arch.o_bias and arch.sliding_layers == (2, 3)
    arch = _hub_arch(tmp_path, model_type="gemma2", head_dim=16, query_pre_attn_scalar=16)
    assert (arch.norm_offset, arch.sandwich_norm, arch.hidden_act) == (
        1.0,
        True,
        "gelu_pytorch_tanh",
    )
    assert (arch.attn_softcap, arch.final_softcap, arch.sliding_layers) == (50.0, 30.0, (0, 2))
    assert arch.embed_scale == 8.0 and arch.scale == 0.25 and arch.tie_word_embeddings
    gemma3 = dict(model_type="gemma3_text", head_dim=16, num_hidden_layers=6, rope_theta=1e6,
                  rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
                  sliding_window=512, sliding_window_pattern=6)  # fmt: skip
    arch = _hub_arch(tmp_path, **gemma3)
    assert arch.sliding_layers == (0, 1, 2, 3, 4) and arch.local_rope_theta == 1e4
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 8.0} and arch.qk_norm
    assert arch.attn_softcap == 0.0 and arch.final_softcap == 0.0
    multimodal = {
        "model_type": "gemma3",
        "text_config": {**HUB, **gemma3},
        "eos_token_id": [1, 106],
    }
    (tmp_path / "config.json").write_text(json.dumps(multimodal))
    assert load_arch(ModelInfo(path=str(tmp_path), architecture="gemma3", vocab_size=10,
                               max_model_len=10, eos_token_ids=())) == arch  # fmt: skip
    phi = dict(model_type="phi3", original_max_position_embeddings=4096,
               max_position_embeddings=131072, partial_rotary_factor=0.75,
               rope_scaling={"type": "longrope", "short_factor": [1.0] * 6,
                             "long_factor": [2.0] * 6})  # fmt: skip
    arch = _hub_arch(tmp_path, **phi)
    assert arch.rope_scaling["rope_type"] == "longrope" and arch.rotary_dim == 12
    assert arch.rope_scaling["original_max_position_embeddings"] == 4096
    arch = _hub_arch(tmp_path, model_type="mixtral", num_local_experts=8, num_experts_per_tok=2)
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (8, 2, 128)
    moe = dict(model_type="qwen2_moe", num_experts=60, num_experts_per_tok=4,
               moe_intermediate_size=32, shared_expert_intermediate_size=96,
               mlp_only_layers=[0], decoder_sparse_step=2)  # fmt: skip
    arch = _hub_arch(tmp_path, **moe)
    assert arch.dense_layers == (0, 2) and not arch.norm_topk_prob
    assert [arch.is_moe(i) for i in range(4)] == [False, True, False, True]
    arch = _hub_arch(tmp_path, model_type="qwen3_moe", num_experts=128, num_experts_per_tok=8,
                     moe_intermediate_size=32, norm_topk_prob=True)  # fmt: skip
    assert arch.qk_norm and arch.norm_topk_prob and arch.shared_expert_intermediate_size == 0


def test_rope_kinds_and_the_context_they_give(tmp_path: Path) -> None:
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    (tmp_path / "config.json").write_text(json.dumps({**HUB, "model_type": "qwen3",
                                                      "max_position_embeddings": 40960,
                                                      "rope_scaling": yarn}))  # fmt: skip
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert resolve_model(str(tmp_path)).max_model_len == 131072  # YaRN's stretched context
    arch = load_arch(resolve_model(str(tmp_path)))
    assert arch.rope_scaling["rope_type"] == "yarn" and arch.max_position == 131072
    for kind in ({"type": "linear", "factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0}):
        arch = _hub_arch(tmp_path, model_type="llama", rope_scaling=kind)
        assert arch.rope_scaling["rope_type"] == kind.get("rope_type", kind.get("type"))


def test_a_family_not_listed_is_refused_naming_it_and_the_list(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**HUB, "model_type": "deepseek_v3"}))
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="'deepseek_v3' is not supported") as err:
        resolve_model(str(tmp_path))
    for name in ("gemma2", "gemma3_text", "mixtral", "phi3", "qwen2_moe", "qwen3", "qwen3_moe"):
        assert f"'{name}'" in str(err.value)
    from gapless.common import families

    with pytest.raises(
        ValueError, match=r"x.gguf: architecture 'falcon' is not supported.*'qwen3moe'"
    ):
        families.for_gguf("falcon", False, "x.gguf")
    assert families.for_gguf("llama", True, "x.gguf").name == "mixtral"
    assert families.for_gguf("llama", False, "x.gguf").name == "llama"


def test_an_option_a_family_lacks_is_refused_when_resolving(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**HUB, "model_type": "llama",
                                                      "mlp_bias": True}))  # fmt: skip
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(NotImplementedError, match="MLP biases"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**HUB, "model_type": "gemma2",
                                                      "hidden_activation": "relu"}))  # fmt: skip
    with pytest.raises(NotImplementedError, match="'relu' is not supported"):
        resolve_model(str(tmp_path))
