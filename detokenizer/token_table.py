"""Text and bytes of single tokens under a byte-level decoder, to decode without the stream."""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import ByteLevel


def _char_bytes() -> dict[str, int]:
    """The byte-level alphabet (GPT-2's): printable chars stand for themselves, the other bytes
    for chars from U+0100 on, in byte order."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {chr(b): b for b in kept}
    moved = [b for b in range(256) if b not in chars.values()]
    chars.update({chr(0x100 + n): b for n, b in enumerate(moved)})
    return chars


_CHAR_BYTES = _char_bytes()
_ALPHABET = frozenset(_CHAR_BYTES)
_TO_LATIN1 = str.maketrans({c: chr(b) for c, b in _CHAR_BYTES.items()})  # char -> its byte
_NONE = ("", b"")  # an id left to the DecodeStream


class TokenTable(dict[int, tuple[str, bytes]]):
    """id -> (text, bytes): what the id adds to the text of a byte-level decode stream.

    A byte-level decoder joins the bytes of all tokens, then decodes them as UTF-8 (U+FFFD for
    bytes that form no character). bytes are the id's share of that; b"" for an id the table
    leaves to the DecodeStream: an added token (skip_special_tokens may drop it) or an unknown
    id. text is those bytes decoded when they are whole UTF-8 without U+FFFD, which is what the
    id adds after a whole character; "" otherwise. One table serves all requests.

    Filled whole when made, with one batched decode: 0.16-0.24 s for SmolLM2's 49,152 ids,
    where a lazy fill, one decode per id on first use, cost 0.35-0.38 s spread over the first
    requests' steps: 36% of the detokenizer's CPU in a 128-stream sim run (py-spy), whose ids
    are spread over the whole vocabulary.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__()
        added = tokenizer.get_added_tokens_decoder()
        # why: decode skips specials by content, so a vocab token spelled like one is skipped too
        skipped = set(added) | {t.content for t in added.values()}
        num_ids = tokenizer.get_vocab_size(with_added_tokens=True)
        texts = tokenizer.decode_batch([[i] for i in range(num_ids)], skip_special_tokens=False)
        for token_id, text in enumerate(texts):
            token = tokenizer.id_to_token(token_id)
            if token is not None and token_id not in skipped and token not in skipped:
                self[token_id] = _entry(token, text)

    @staticmethod
    def of(tokenizer: Tokenizer) -> TokenTable | None:
        """None unless the tokenizer's decoder is byte-level (GPT-2, Llama 3, Qwen, SmolLM)."""
        return TokenTable(tokenizer) if isinstance(tokenizer.decoder, ByteLevel) else None

    def bytes_of(self, ids: list[int]) -> bytes:
        """The bytes ids add, b"" if the table leaves one of them to the stream."""
        parts = [self[token_id][1] for token_id in ids]
        return b"".join(parts) if all(parts) else b""

    def __missing__(self, token_id: int) -> tuple[str, bytes]:
        return _NONE  # why not stored: an unbounded key space


def _entry(token: str, text: str) -> tuple[str, bytes]:
    """What a token spelled `token`, decoding alone to `text`, adds to a byte-level stream."""
    # as the decoder: a token that is not all in the alphabet stands for its own UTF-8
    if _ALPHABET.issuperset(token):
        data = token.translate(_TO_LATIN1).encode("latin-1")
    else:
        data = token.encode()
    if not data or data.decode(errors="replace") != text:  # why: not the decoder's bytes
        return _NONE
    return ("" if "\ufffd" in text else text), data
