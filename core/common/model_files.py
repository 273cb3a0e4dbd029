"""Model metadata, architecture and tokenizer from a Hugging Face directory or a GGUF file.

No torch here: the frontend imports this module. Weights load in gpu_runner/weights.py.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from gapless.core.common import hub
from gapless.core.common.config import ModelInfo
from gapless.core.common.model_cache import default_model_path

# model_type in config.json (or general.architecture in GGUF) -> our architecture name
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}


class ModelArch(msgspec.Struct, frozen=True, kw_only=True):
    """Shapes and constants of a Llama-family decoder."""

    architecture: str  # "llama" or "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry biases (qwen2)
    # llama3-style: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
    rope_scaling: dict | None = None


# ---------------------------------------------------------------------------------------------
# GGUF header reader. gguf.GGUFReader parses every array element into its own numpy view, which
# takes ~5 s on SmolLM2's 98k tokenizer strings; this reads the same header in ~0.1 s.

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}  # fmt: skip
_ARRAY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
                 10: "<u8", 11: "<i8", 12: "<f8"}  # fmt: skip
_STRING, _ARRAY = 8, 9


class GGUFTensor(msgspec.Struct, frozen=True):
    name: str
    shape: tuple[int, ...]  # torch order: [out, in] (GGUF stores dims innermost first)
    qtype: int  # gguf.GGMLQuantizationType value
    offset: int  # absolute byte offset of the data in the file


class GGUFFile(msgspec.Struct, frozen=True):
    path: str
    metadata: dict[str, Any]  # arrays of numbers are numpy arrays, of strings lists
    tensors: dict[str, GGUFTensor]


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        text = self.buf[self.pos : self.pos + n].decode("utf-8")
        self.pos += n
        return text

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.scalar("<I"), self.scalar("<Q")
            if itype == _STRING:
                return [self.string() for _ in range(count)]
            if itype in _ARRAY_DTYPES:
                dtype = np.dtype(_ARRAY_DTYPES[itype])
                arr = np.frombuffer(self.buf, dtype, count, self.pos).copy()
                self.pos += count * dtype.itemsize
                return arr
            return [self.value(itype) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"GGUF value type {vtype} is unknown")
        value = self.scalar(_SCALARS[vtype])
        return float(str(np.float32(value))) if vtype == 6 else value  # f32 1e-5, not 9.99e-06


def read_gguf(path: str | Path) -> GGUFFile:
    """Metadata and tensor directory of a GGUF file (v2/v3), without reading tensor data."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf)
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
        cur.pos = 4
        version = cur.scalar("<I")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported (need 2 or 3)")
        num_tensors, num_kv = cur.scalar("<Q"), cur.scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.scalar("<I"))
        infos = []
        for _ in range(num_tensors):
            name = cur.string()
            ndim = cur.scalar("<I")
            dims = [cur.scalar("<Q") for _ in range(ndim)]
            infos.append((name, tuple(reversed(dims)), cur.scalar("<I"), cur.scalar("<Q")))
        align = int(metadata.get("general.alignment", 32))
        data_start = (cur.pos + align - 1) // align * align
    tensors = {n: GGUFTensor(n, shape, qtype, data_start + off) for n, shape, qtype, off in infos}
    return GGUFFile(str(path), metadata, tensors)


# ---------------------------------------------------------------------------------------------
# resolve_model


def _is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    # tokenizer_config writes special tokens as a string or as an AddedToken dict
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _hf_token_id(tokenizer_json: dict, text: str | None) -> int | None:
    if text is None:
        return None
    for added in tokenizer_json.get("added_tokens", []):
        if added.get("content") == text:
            return int(added["id"])
    vocab = tokenizer_json.get("model", {}).get("vocab")
    if isinstance(vocab, dict):
        return vocab.get(text)
    return None


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _unique(ids: list[int]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(ids))


def _check_dir(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} has no config.json; expected a Hugging Face model directory")
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"{path} has no tokenizer.json (only fast tokenizers are supported)")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"{path} has no *.safetensors weights (other formats are not loaded)")


def _architecture(name: str, source: str) -> str:
    if name not in ARCHITECTURES:
        raise ValueError(
            f"{source}: architecture {name!r} is not supported (supported: {sorted(ARCHITECTURES)})"
        )
    return ARCHITECTURES[name]


def _hf_chat_template(path: Path, tok_config: dict) -> str | None:
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _adds_bos(tokenizer_json: dict, bos: str | None) -> bool:
    # without an add_bos_token flag, the post-processor's template says whether BOS is added
    post = tokenizer_json.get("post_processor") or {}
    steps = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    for step in steps:
        for piece in step.get("single", []) or []:
            if "SpecialToken" in piece and piece["SpecialToken"].get("id") == bos:
                return True
    return False


def _resolve_hf(path: Path, cap: int | None) -> ModelInfo:
    _check_dir(path)
    config = _read_json(path / "config.json")
    arch = _architecture(str(config.get("model_type")), str(path / "config.json"))
    tok_config = _read_json(path / "tokenizer_config.json")
    tok_json = _read_json(path / "tokenizer.json")
    gen_config = _read_json(path / "generation_config.json")
    eos_text = _token_text(tok_config.get("eos_token"))
    bos_text = _token_text(tok_config.get("bos_token"))
    eos = _ids(config.get("eos_token_id")) + _ids(gen_config.get("eos_token_id"))
    eos += _ids(_hf_token_id(tok_json, eos_text))
    bos = config.get("bos_token_id")
    if bos is None:
        bos = _hf_token_id(tok_json, bos_text)
    add_bos = tok_config.get("add_bos_token")
    if add_bos is None:
        add_bos = _adds_bos(tok_json, bos_text)
    context = int(config.get("max_position_embeddings", 2048))
    return ModelInfo(
        path=str(path),
        architecture=arch,
        vocab_size=int(config["vocab_size"]),
        max_model_len=min(context, cap) if cap else context,
        eos_token_ids=_unique(eos),
        bos_token_id=None if bos is None else int(bos),
        add_bos_token=bool(add_bos),
        chat_template=_hf_chat_template(path, tok_config),
        sampling_defaults=_sampling_defaults(gen_config),
    )


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _sampling_defaults(gen_config: dict) -> dict[str, float]:
    """generation_config.json's sampling values. `do_sample` is not read: a request's own
    temperature says whether it samples, as the OpenAI API has it."""
    return {
        key: float(gen_config[key])
        for key in SAMPLING_KEYS
        if isinstance(gen_config.get(key), int | float) and not isinstance(gen_config[key], bool)
    }


def _with_tokenizer(info: ModelInfo, source: str) -> ModelInfo:
    """info, its tokenizer (and that tokenizer's chat template and BOS rule) taken from
    `source`: a directory with tokenizer.json or a Hub id."""
    path = hub.local_path(source, tokenizer_only=True)
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"--tokenizer {source}: {path} has no tokenizer.json")
    tok_config = _read_json(path / "tokenizer_config.json")
    tok_json = _read_json(path / "tokenizer.json")
    bos_text = _token_text(tok_config.get("bos_token"))
    add_bos = tok_config.get("add_bos_token")
    if add_bos is None:
        add_bos = _adds_bos(tok_json, bos_text)
    bos = _hf_token_id(tok_json, bos_text)
    return msgspec.structs.replace(
        info,
        tokenizer=str(path),
        chat_template=_hf_chat_template(path, tok_config) or info.chat_template,
        add_bos_token=bool(add_bos),
        bos_token_id=info.bos_token_id if bos is None else bos,
    )


def _gguf_vocab_size(gguf: GGUFFile, arch: str) -> int:
    if f"{arch}.vocab_size" in gguf.metadata:
        return int(gguf.metadata[f"{arch}.vocab_size"])
    if "tokenizer.ggml.tokens" in gguf.metadata:
        return len(gguf.metadata["tokenizer.ggml.tokens"])
    raise ValueError(f"{gguf.path}: no tokenizer.ggml.tokens, cannot tell the vocabulary size")


def _resolve_gguf(path: Path, cap: int | None) -> ModelInfo:
    gguf = read_gguf(path)
    meta = gguf.metadata
    name = str(meta.get("general.architecture"))
    arch = _architecture(name, str(path))
    eos = _ids(meta.get("tokenizer.ggml.eos_token_id")) + _ids(
        meta.get("tokenizer.ggml.eot_token_id")
    )
    bos = meta.get("tokenizer.ggml.bos_token_id")
    # llama.cpp adds BOS to sentencepiece vocabularies that do not say otherwise
    add_bos = meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama")
    context = int(meta.get(f"{name}.context_length", 2048))
    return ModelInfo(
        path=str(path),
        architecture=arch,
        vocab_size=_gguf_vocab_size(gguf, name),
        max_model_len=min(context, cap) if cap else context,
        eos_token_ids=_unique(eos),
        bos_token_id=None if bos is None else int(bos),
        add_bos_token=bool(add_bos),
        chat_template=meta.get("tokenizer.chat_template"),
    )


def resolve_model(
    model: str | None, max_model_len: int | None = None, tokenizer: str | None = None
) -> ModelInfo:
    """Facts about a model (no weights read): a HF directory, a Hub id (`org/name`, from the
    local Hub cache), a .gguf file, or None (default); `tokenizer` another tokenizer's
    directory or Hub id."""
    if max_model_len is not None and max_model_len <= 0:
        raise ValueError(f"max_model_len must be positive, got {max_model_len}")
    path = hub.local_path(model) if model is not None else default_model_path()
    if not path.exists():
        raise ValueError(f"model path {path} does not exist")
    if path.is_dir():
        info = _resolve_hf(path, max_model_len)
    elif _is_gguf(path):
        info = _resolve_gguf(path, max_model_len)
    else:
        raise ValueError(f"{path} is neither a Hugging Face model directory nor a .gguf file")
    return _with_tokenizer(info, tokenizer) if tokenizer else info


# ---------------------------------------------------------------------------------------------
# load_arch


def _rope_scaling(config: dict) -> dict | None:
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise NotImplementedError(f"rope scaling {kind!r} is not supported (only llama3)")
    return {
        "factor": float(scaling["factor"]),
        "low_freq_factor": float(scaling["low_freq_factor"]),
        "high_freq_factor": float(scaling["high_freq_factor"]),
        "original_max_position_embeddings": int(scaling["original_max_position_embeddings"]),
    }


def _arch_from_config(info: ModelInfo, config: dict) -> ModelArch:
    arch = info.architecture
    if config.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act {config['hidden_act']!r} is not supported")
    if config.get("mlp_bias"):
        raise NotImplementedError("MLP biases are not supported")
    if arch == "llama" and config.get("attention_bias"):
        raise NotImplementedError("llama with attention_bias (o_proj bias) is not supported")
    window = config.get("sliding_window")
    uses_window = config.get("use_sliding_window", config.get("model_type") == "mistral")
    context = int(config.get("max_position_embeddings", 2048))
    if uses_window and window and window < context:
        raise NotImplementedError(f"sliding-window attention ({window}) is not supported")
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    theta = config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta"))
    return ModelArch(
        architecture=arch,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        rope_theta=float(theta if theta is not None else 10000.0),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_position=context,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2",
        rope_scaling=_rope_scaling(config),
    )


def _arch_from_gguf(info: ModelInfo, gguf: GGUFFile) -> ModelArch:
    meta, name = gguf.metadata, str(gguf.metadata["general.architecture"])

    def key(suffix: str, default: Any = None) -> Any:
        value = meta.get(f"{name}.{suffix}", default)
        if value is None:
            raise ValueError(f"{gguf.path}: metadata {name}.{suffix} is missing")
        if isinstance(value, np.ndarray):
            raise NotImplementedError(f"{gguf.path}: per-layer {name}.{suffix} is not supported")
        return value

    if meta.get(f"{name}.expert_count"):
        raise NotImplementedError(f"{gguf.path}: mixture-of-experts models are not supported")
    scaling = meta.get(f"{name}.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in gguf.tensors:
        raise NotImplementedError(f"{gguf.path}: GGUF rope scaling is not supported")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    return ModelArch(
        architecture=info.architecture,
        vocab_size=_gguf_vocab_size(gguf, name),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(key("attention.key_length", hidden // heads)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        max_position=int(key("context_length")),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias="blk.0.attn_q.bias" in gguf.tensors,
    )


def load_arch(info: ModelInfo) -> ModelArch:
    """Architecture of a resolved model, from config.json or GGUF metadata."""
    path = Path(info.path)
    if path.is_dir():
        return _arch_from_config(info, _read_json(path / "config.json"))
    return _arch_from_gguf(info, read_gguf(path))


# ---------------------------------------------------------------------------------------------
# load_tokenizer

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (split regex, digits split one by one first)
_PRE_TOKENIZERS = {
    "default": (_GPT2_SPLIT, False),
    "gpt2": (_GPT2_SPLIT, False),
    "gpt-2": (_GPT2_SPLIT, False),
    "smollm": (_GPT2_SPLIT, True),
    "starcoder": (_GPT2_SPLIT, True),
    "llama-bpe": (_LLAMA3_SPLIT, False),
    "llama3": (_LLAMA3_SPLIT, False),
    "llama-v3": (_LLAMA3_SPLIT, False),
    "smaug-bpe": (_LLAMA3_SPLIT, False),
    "qwen2": (_QWEN2_SPLIT, False),
    "deepseek-r1-qwen": (_QWEN2_SPLIT, False),
}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def _byte_alphabet() -> list[str]:
    """Byte b -> the printable character byte-level BPE spells it with (the GPT-2 mapping)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelling, extra = {}, 0
    for b in range(256):
        if b in printable:
            spelling[b] = chr(b)
        else:
            spelling[b] = chr(256 + extra)
            extra += 1
    return [spelling[b] for b in range(256)]


def _byte_level_pre(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre not in _PRE_TOKENIZERS:
        raise NotImplementedError(
            f"GGUF pre-tokenizer {pre!r} is not supported (supported: {sorted(_PRE_TOKENIZERS)})"
        )
    split, digits = _PRE_TOKENIZERS[pre]
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


def _special_tokens(types: np.ndarray) -> tuple[list[int], list[int]]:
    control = np.flatnonzero(types == _CONTROL).tolist()
    user = np.flatnonzero(types == _USER_DEFINED).tolist()
    return control, user


def _add_specials(tok: Tokenizer, tokens: list[str], control: list[int], user: list[int]) -> None:
    # kept verbatim in the vocabulary, so each keeps its own id here
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in control])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])


def _vocab(spellings: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, token in enumerate(spellings):
        vocab.setdefault(token, i)  # first id wins on duplicates
    return vocab


def _byte_level_tokenizer(meta: dict) -> Tokenizer:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types = np.asarray(meta.get("tokenizer.ggml.token_type", np.ones(len(tokens))))
    control, user = _special_tokens(types)
    alphabet = _byte_alphabet()
    allowed = set(alphabet)
    verbatim = set(control) | set(user)

    # a normal token spelled outside the byte alphabet is a mislabel: spell its UTF-8 bytes
    spellings = [
        t if i in verbatim or set(t) <= allowed else "".join(alphabet[b] for b in t.encode())
        for i, t in enumerate(tokens)
    ]
    vocab = _vocab(spellings)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _byte_level_pre(str(meta.get("tokenizer.ggml.pre", "default")))
    tok.decoder = decoders.ByteLevel()
    _add_specials(tok, tokens, control, user)
    return tok


def _sentencepiece_merges(tokens: list[str], scores: np.ndarray) -> list[tuple[str, str]]:
    # each token that splits into two vocabulary pieces is a merge, ranked by the token's score
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for token, i in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-float(scores[i]), vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_tokenizer(meta: dict) -> Tokenizer:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types = np.asarray(meta.get("tokenizer.ggml.token_type", np.ones(len(tokens))))
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    elif "tokenizer.ggml.scores" in meta:
        merges = _sentencepiece_merges(tokens, np.asarray(meta["tokenizer.ggml.scores"]))
    else:
        raise ValueError("sentencepiece GGUF has neither tokenizer.ggml.merges nor scores")
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else None
    model = models.BPE(
        vocab=_vocab(tokens), merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True
    )
    tok = Tokenizer(model)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    tok.normalizer = None
    control, user = _special_tokens(types)
    _add_specials(tok, tokens, control, user)
    return tok


def load_tokenizer(info: ModelInfo) -> Tokenizer:
    """The model's tokenizer. It adds no BOS itself for GGUF; prepend info.bos_token_id when
    info.add_bos_token (encode with add_special_tokens=False for a HF tokenizer.json)."""
    if info.tokenizer:
        return Tokenizer.from_file(str(Path(info.tokenizer) / "tokenizer.json"))
    path = Path(info.path)
    if path.is_dir():
        return Tokenizer.from_file(str(path / "tokenizer.json"))
    meta = read_gguf(path).metadata
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        return _byte_level_tokenizer(meta)
    if kind == "llama":
        return _sentencepiece_tokenizer(meta)
    raise NotImplementedError(f"{path}: GGUF tokenizer model {kind!r} is not supported")
