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
_NONE = ("", b"")  # an id left to the DecodeStream


class TokenTable(dict[int, tuple[str, bytes]]):
    """id -> (text, bytes): what the id adds to the text of a byte-level decode stream.

    A byte-level decoder joins the bytes of all tokens, then decodes them as UTF-8 (U+FFFD for
    bytes that form no character). bytes are the id's share of that; b"" for an id the table
    leaves to the DecodeStream: an added token (skip_special_tokens may drop it) or an unknown
    id. text is those bytes decoded when they are whole UTF-8 without U+FFFD, which is what the
    id adds after a whole character; "" otherwise. Filled lazily, one decode per id the first
    time it is asked for; one table serves all requests.
    """

    __slots__ = ("_tokenizer", "_added", "_num_ids")

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__()
        self._tokenizer = tokenizer
        added = tokenizer.get_added_tokens_decoder()
        # why: decode skips specials by content, so a vocab token spelled like one is skipped too
        self._added = set(added) | {t.content for t in added.values()}
        self._num_ids = tokenizer.get_vocab_size(with_added_tokens=True)

    @staticmethod
    def of(tokenizer: Tokenizer) -> TokenTable | None:
        """None unless the tokenizer's decoder is byte-level (GPT-2, Llama 3, Qwen, SmolLM)."""
        return TokenTable(tokenizer) if isinstance(tokenizer.decoder, ByteLevel) else None

    def bytes_of(self, ids: list[int]) -> bytes:
        """The bytes ids add, b"" if the table leaves one of them to the stream."""
        parts = [self[token_id][1] for token_id in ids]
        return b"".join(parts) if all(parts) else b""

    def __missing__(self, token_id: int) -> tuple[str, bytes]:
        if not 0 <= token_id < self._num_ids:  # why: not stored, an unbounded key space
            return _NONE
        entry = self[token_id] = self._look_up(token_id)
        return entry

    def _look_up(self, token_id: int) -> tuple[str, bytes]:
        token = self._tokenizer.id_to_token(token_id)
        if token is None or token_id in self._added or token in self._added:
            return _NONE
        chars = _CHAR_BYTES
        # as the decoder: a token that is not all in the alphabet stands for its own UTF-8
        data = bytes(chars[c] for c in token) if all(c in chars for c in token) else token.encode()
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        if not data or data.decode(errors="replace") != text:  # why: not the decoder's bytes
            return _NONE
        return ("" if "\ufffd" in text else text), data
