"""One request's incremental detokenization: streaming decode, stop strings, its deltas."""

from __future__ import annotations

from codecs import utf_8_decode

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from gapless.common.messages import DetokNew, TextDelta, TokenLogprob
from gapless.detokenizer.stop import StopMatcher
from gapless.detokenizer.token_table import TokenTable


class RequestDetokenizer:
    """Turns a request's tokens into TextDeltas until its stream ends (`is_done`): the state
    forgets it then (docs/architecture.md, "A request's end").

    Text comes out exactly as tokenizers' DecodeStream.step releases it. With a byte-level
    tokenizer (`table`), the request tracks the stream's state itself instead of calling it:
    the window `_last` (ids whose text is out, ending on a whole character) then `_undecoded`
    (their bytes in `_pending`). A token outside the table, or bytes that are not UTF-8, rebuild
    the stream in that state and let it decide, until it releases text again.

    why not the stream for every token: it is a call into Rust per token (~0.5 us) besides the
    Python around it; with the table, one step of 256 requests (tests/detokenizer/test_bench.py,
    quiet machine) went from 390-396 / 401-407 us (min / median) to 138-147 / 146-156 us.
    tests/detokenizer/test_token_table.py checks it against the stream token by token.
    """

    __slots__ = (
        "request_id",
        "frontend_id",
        "num_top",
        "num_output_tokens",
        "is_done",
        "stop_hit",
        "_tokenizer",
        "_table",
        "_whole",
        "_skip_special",
        "_include_stop",
        "_stream",
        "_last",
        "_pending",
        "_stop",
        "_undecoded",
        "_unsent",
        "num_prompt_top",
        "prompt_logprobs",
    )

    def __init__(
        self, tokenizer: Tokenizer, new: DetokNew, table: TokenTable | None = None
    ) -> None:
        params = new.params
        self.request_id = new.request_id
        self.frontend_id = new.frontend_id
        self.num_top = params.logprobs  # None: no logprobs; k: sampled token plus top k
        self.num_prompt_top = params.prompt_logprobs
        self.prompt_logprobs: list[TokenLogprob] | None = None  # sent with the next delta
        self.num_output_tokens = 0  # tokens counted in usage, cumulative
        self.is_done = False
        self.stop_hit = False  # a stop string ended the request; the core must be told
        self._tokenizer = tokenizer
        skip = self._skip_special = params.skip_special_tokens
        self._include_stop = params.include_stop_str_in_output
        # the prompt tail is context only: the first output token decodes as it would in place
        tail = new.prompt_tail
        # why: a tail ending inside a character is not a window the table can extend
        if table is not None and tokenizer.decode(tail, skip_special_tokens=skip).endswith(
            "\ufffd"
        ):
            table = None
        self._table = table  # None: every token goes through the stream
        self._stream = DecodeStream(tail, skip) if table is None else None  # None: not in use
        self._last: list[int] = list(tail)  # the stream's window, while _stream is None
        self._pending = b""  # bytes of _undecoded, while _stream is None
        self._whole = table is not None  # _stream is None and no bytes are pending
        stops = tuple(s for s in params.stop if s)
        self._stop = StopMatcher(stops, params.include_stop_str_in_output) if stops else None
        self._undecoded: list[int] = []  # ids in the stream whose text is not out (partial UTF-8)
        self._unsent: list[int] = []  # ids of steps that produced no delta

    def step_token(self, token_id: int, num_prompt_tokens: int) -> TextDelta | None:
        """step([token_id], "", num_prompt_tokens, None): one token of a running request."""
        if self.prompt_logprobs is not None:
            return self.step([token_id], "", num_prompt_tokens, None)
        ids = [token_id]
        self.num_output_tokens += 1
        table = self._table
        if table is not None and self._stream is None:  # _next's table path, without its call
            text, data = table[token_id]
            if text and self._whole:  # the common token: whole bytes after a whole character
                self._last = ids
            else:
                text = self._next_bytes(ids, data)
        else:
            text = self._next(ids)
        if text is None:
            self._unsent.append(token_id)
            return None
        if self._stop is not None:
            text = self._stop.feed(text)
            if self._stop.hit:
                return self._stopped(text, ids, num_prompt_tokens)
            if not text:
                self._unsent.append(token_id)
                return None
        if self._unsent:
            ids, self._unsent = self._unsent + ids, []
        return TextDelta(self.request_id, text, ids, num_prompt_tokens, self.num_output_tokens)

    def _stopped(self, text: str, ids: list[int], num_prompt_tokens: int) -> TextDelta:
        """The last delta of step_token when its token completed a stop string."""
        self.stop_hit = self.is_done = True
        if self._unsent:
            ids, self._unsent = self._unsent + ids, []
        n = self.num_output_tokens
        return TextDelta(self.request_id, text, ids, num_prompt_tokens, n, "stop")

    def step(
        self,
        ids: list[int],
        end: str,
        num_prompt_tokens: int,
        logprobs: list[TokenLogprob] | None,
        error: str = "",
    ) -> TextDelta | None:
        """One step's tokens; end is "" while running, else the core's EndReason."""
        if end == "abort":  # the client is gone: nothing to send
            self.is_done = True
            return None
        num_text = len(ids)
        if end == "stop_token" and not self._include_stop:
            num_text -= 1  # the EOS or stop token id that ended it: its text is withheld
        text, used = self._decode(ids, num_text)
        if used < len(ids):  # a stop string completed before the step's last token
            ids = ids[:used]
            if logprobs is not None:
                logprobs = logprobs[:used]
        self.num_output_tokens += used
        reason: str | None = None
        code = None
        if self.stop_hit:
            reason = "stop"
        elif end:
            text += self._flush()
            reason = "stop" if self.stop_hit or end == "stop_token" else end
            if reason == "queue_timeout":  # the client's load, not an engine fault
                reason, code = "error", "queue_timeout"
        if reason is None and not text and logprobs is None:
            self._unsent.extend(ids)
            return None
        if self._unsent:
            ids, self._unsent = self._unsent + ids, []
        self.is_done = reason is not None
        prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
        return TextDelta(
            self.request_id,
            text,
            ids,
            num_prompt_tokens,
            self.num_output_tokens,
            reason,
            logprobs,
            (error or "engine error") if reason == "error" else None,
            code,
            prompt_logprobs=prompt_logprobs,
        )

    def fail(self, message: str, num_prompt_tokens: int) -> TextDelta:
        """End the request with an error after something went wrong while handling it."""
        self.is_done = True
        ids, self._unsent = self._unsent, []
        n = self.num_output_tokens
        return TextDelta(self.request_id, "", ids, num_prompt_tokens, n, "error", None, message)

    def _decode(self, ids: list[int], num_text: int) -> tuple[str, int]:
        """Released text of ids[:num_text] and how many ids count (fewer after a stop string)."""
        stop = self._stop
        if stop is None:
            if num_text <= 0:
                return "", len(ids)
            return self._next(ids[:num_text]) or "", len(ids)
        parts: list[str] = []
        for j in range(num_text):  # one by one: the token that completes a stop string counts
            piece = self._next(ids[j : j + 1])
            if piece is None:
                continue
            parts.append(stop.feed(piece))
            if stop.hit:
                self.stop_hit = True
                return "".join(parts), j + 1
        return "".join(parts), len(ids)

    def _next(self, ids: list[int]) -> str | None:
        """What DecodeStream.step(ids) returns: the text ids release, None while they end inside
        a character (their ids wait in _undecoded)."""
        table = self._table
        if table is None or self._stream is not None:
            return self._stream_next(ids)
        if len(ids) > 1:
            return self._next_bytes(ids, table.bytes_of(ids))
        text, data = table[ids[0]]
        if text and self._whole:  # whole bytes after a whole character
            self._last = ids
            return text
        return self._next_bytes(ids, data)

    def _next_bytes(self, ids: list[int], data: bytes) -> str | None:
        """_next of ids that add data (b"": not in the table) while _stream is None."""
        if not data:
            return self._stream_next(ids)
        if self._pending:
            data = self._pending + data
        try:
            text, size = utf_8_decode(data, None, False)  # stops before a cut character
        except UnicodeDecodeError:  # why: only the stream knows where it puts U+FFFD
            return self._stream_next(ids)
        # the stream holds back text ending in U+FFFD, a cut character's as a whole one's
        if size < len(data) or text.endswith("\ufffd"):
            self._pending = data
            self._undecoded += ids
            self._whole = False
            return None
        self._last = self._undecoded + ids if self._undecoded else ids
        self._undecoded, self._pending, self._whole = [], b"", True
        return text

    def _stream_next(self, ids: list[int]) -> str | None:
        """_next by the DecodeStream itself."""
        stream = self._stream
        if stream is None:  # rebuilt in the state the table kept
            stream = self._stream = DecodeStream(self._last, self._skip_special)
            if self._undecoded:
                held = stream.step(self._tokenizer, self._undecoded)
                assert held is None, "the token table held back text the stream releases"
            self._pending, self._whole = b"", False
        piece = stream.step(self._tokenizer, ids[0] if len(ids) == 1 else ids)
        if piece is None:
            self._undecoded += ids
            return None
        if self._table is not None:  # its window is now these ids: back to the table
            self._last = self._undecoded + ids
            self._stream, self._whole = None, True
        self._undecoded = []
        return piece

    def _flush(self) -> str:
        """Text still inside the request when the core ends it."""
        text = ""
        if self._undecoded:  # bytes that never became a whole character: U+FFFD, as decode()
            text = self._tokenizer.decode(self._undecoded, skip_special_tokens=self._skip_special)
            self._undecoded, self._pending, self._whole = [], b"", self._stream is None
        if self._stop is None:
            return text
        out = self._stop.feed(text) if text else ""
        if self._stop.hit:
            self.stop_hit = True
            return out
        return out + self._stop.flush()
