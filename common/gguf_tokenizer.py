"""A fast tokenizer rebuilt from a GGUF file's tokenizer metadata (byte-level BPE and
sentencepiece vocabularies), as llama.cpp reads them."""

from __future__ import annotations

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

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


def gguf_tokenizer(meta: dict, source: str) -> Tokenizer:
    """The tokenizer of a GGUF file's metadata; `source` names the file in errors."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        return _byte_level_tokenizer(meta)
    if kind == "llama":
        return _sentencepiece_tokenizer(meta)
    raise NotImplementedError(f"{source}: GGUF tokenizer model {kind!r} is not supported")
