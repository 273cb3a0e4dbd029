"""Model metadata, architecture and tokenizer from a Hugging Face directory or a GGUF file.

No torch here: the frontend imports this module. Weights load in gpu_runner/model/weights.py; the
families and their options are in common/families/.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from tokenizers import Tokenizer

from gapless.common import families, hub
from gapless.common.config import ModelInfo
from gapless.common.families import GGUFMeta, ModelArch
from gapless.common.families.base import context_length
from gapless.common.gguf_file import GGUFFile, GGUFTensor, read_gguf
from gapless.common.gguf_tokenizer import gguf_tokenizer
from gapless.common.model_cache import default_model_path

__all__ = ["GGUFFile", "GGUFTensor", "ModelArch", "gguf_meta", "gguf_vocab_size", "load_arch",
           "load_tokenizer", "model_path", "read_gguf", "read_json", "resolve_model"]  # fmt: skip


def _is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def read_json(path: Path) -> dict:
    """A JSON object file's contents ({} when there is none); ValueError naming the file and
    where its syntax breaks."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: a JSON {type(value).__name__}, not an object")
    return value


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
    raw = read_json(path / "config.json")
    family, config = families.read_config(raw, str(path / "config.json"))
    # why here: a family's refusal before any spawn
    arch = families.arch_from_config(raw, str(path / "config.json"))
    tok_config = read_json(path / "tokenizer_config.json")
    tok_json = read_json(path / "tokenizer.json")
    gen_config = read_json(path / "generation_config.json")
    eos_text = _token_text(tok_config.get("eos_token"))
    bos_text = _token_text(tok_config.get("bos_token"))
    eos = _ids(raw.get("eos_token_id")) + _ids(config.get("eos_token_id"))
    eos += _ids(gen_config.get("eos_token_id"))
    eos += _ids(_hf_token_id(tok_json, eos_text))
    bos = raw.get("bos_token_id", config.get("bos_token_id"))
    if bos is None:
        bos = _hf_token_id(tok_json, bos_text)
    add_bos = tok_config.get("add_bos_token")
    if add_bos is None:
        add_bos = _adds_bos(tok_json, bos_text)
    context = context_length(config)
    return ModelInfo(
        path=str(path),
        architecture=family.name,
        vocab_size=int(config["vocab_size"]),
        max_model_len=min(context, cap) if cap else context,
        eos_token_ids=_unique(eos),
        bos_token_id=None if bos is None else int(bos),
        add_bos_token=bool(add_bos),
        chat_template=_hf_chat_template(path, tok_config),
        sampling_defaults=_sampling_defaults(gen_config),
        kv_window=arch.kv_window,
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
    tok_config = read_json(path / "tokenizer_config.json")
    tok_json = read_json(path / "tokenizer.json")
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


def gguf_vocab_size(gguf: GGUFFile, arch: str) -> int:
    if f"{arch}.vocab_size" in gguf.metadata:
        return int(gguf.metadata[f"{arch}.vocab_size"])
    if "tokenizer.ggml.tokens" in gguf.metadata:
        return len(gguf.metadata["tokenizer.ggml.tokens"])
    raise ValueError(f"{gguf.path}: no tokenizer.ggml.tokens, cannot tell the vocabulary size")


def _resolve_gguf(path: Path, cap: int | None) -> ModelInfo:
    gguf = read_gguf(path)
    meta = gguf.metadata
    name = str(meta.get("general.architecture"))
    family = families.for_gguf(name, bool(meta.get(f"{name}.expert_count")), str(path))
    eos = _ids(meta.get("tokenizer.ggml.eos_token_id")) + _ids(
        meta.get("tokenizer.ggml.eot_token_id")
    )
    bos = meta.get("tokenizer.ggml.bos_token_id")
    # llama.cpp adds BOS to sentencepiece vocabularies that do not say otherwise
    add_bos = meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama")
    context = int(meta.get(f"{name}.context_length", 2048))
    return ModelInfo(
        path=str(path),
        architecture=family.name,
        vocab_size=gguf_vocab_size(gguf, name),
        max_model_len=min(context, cap) if cap else context,
        eos_token_ids=_unique(eos),
        bos_token_id=None if bos is None else int(bos),
        add_bos_token=bool(add_bos),
        chat_template=meta.get("tokenizer.chat_template"),
    )  # kv_window stays 0: no family reads a window over every layer from GGUF metadata


def model_path(model: str | None) -> Path:
    """Where the model's files are: a path, a Hub id's local snapshot, or None's default."""
    path = hub.local_path(model) if model is not None else default_model_path()
    if not path.exists():
        raise ValueError(f"model path {path} does not exist")
    return path


def resolve_model(
    model: str | None, max_model_len: int | None = None, tokenizer: str | None = None
) -> ModelInfo:
    """Facts about a model (no weights read): a HF directory, a Hub id (`org/name`, from the
    local Hub cache), a .gguf file, or None (default); `tokenizer` another tokenizer's
    directory or Hub id."""
    if max_model_len is not None and max_model_len <= 0:
        raise ValueError(f"max_model_len must be positive, got {max_model_len}")
    path = model_path(model)
    if path.is_dir():
        info = _resolve_hf(path, max_model_len)
    elif _is_gguf(path):
        info = _resolve_gguf(path, max_model_len)
    else:
        raise ValueError(f"{path} is neither a Hugging Face model directory nor a .gguf file")
    return _with_tokenizer(info, tokenizer) if tokenizer else info


# ---------------------------------------------------------------------------------------------
# load_arch


def gguf_meta(gguf: GGUFFile) -> GGUFMeta:
    """A GGUF file's metadata as families read it."""
    arch = str(gguf.metadata.get("general.architecture"))

    def read_f32(name: str) -> np.ndarray:
        t = gguf.tensors[name]
        count = math.prod(t.shape)
        if t.qtype != 0 or t.offset + 4 * count > Path(gguf.path).stat().st_size:  # 0: F32
            raise ValueError(f"{gguf.path}: {name} is not {count} F32 values within the file")
        return np.fromfile(gguf.path, dtype="<f4", count=count, offset=t.offset)

    return GGUFMeta(gguf.path, arch, gguf.metadata, frozenset(gguf.tensors), read_f32)


def load_arch(info: ModelInfo) -> ModelArch:
    """Architecture of a resolved model, from config.json or GGUF metadata."""
    path = Path(info.path)
    if path.is_dir():
        config = path / "config.json"
        return families.arch_from_config(read_json(config), str(config))
    gguf = read_gguf(path)
    meta = gguf_meta(gguf)
    return families.arch_from_gguf(meta, gguf_vocab_size(gguf, meta.arch))


# ---------------------------------------------------------------------------------------------
# load_tokenizer


def load_tokenizer(info: ModelInfo) -> Tokenizer:
    """The model's tokenizer. It adds no BOS itself for GGUF; prepend info.bos_token_id when
    info.add_bos_token (encode with add_special_tokens=False for a HF tokenizer.json)."""
    if info.tokenizer:
        return Tokenizer.from_file(str(Path(info.tokenizer) / "tokenizer.json"))
    path = Path(info.path)
    if path.is_dir():
        return Tokenizer.from_file(str(path / "tokenizer.json"))
    return gguf_tokenizer(read_gguf(path).metadata, str(path))
