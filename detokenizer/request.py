"""One request's incremental detokenization: streaming decode, stop strings, its deltas."""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from gapless.core.common.messages import DetokNew, TextDelta, TokenLogprob
from gapless.detokenizer.stop import StopMatcher


class RequestDetokenizer:
    """Turns a request's tokens into TextDeltas until its stream ends (`is_done`): the state
    forgets it then (docs/architecture.md, "A request's end")."""

    __slots__ = (
        "request_id",
        "frontend_id",
        "num_top",
        "num_output_tokens",
        "is_done",
        "stop_hit",
        "_tokenizer",
        "_skip_special",
        "_include_stop",
        "_stream",
        "_stop",
        "_undecoded",
        "_unsent",
        "num_prompt_top",
        "prompt_logprobs",
    )

    def __init__(self, tokenizer: Tokenizer, new: DetokNew) -> None:
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
        self._skip_special = params.skip_special_tokens
        self._include_stop = params.include_stop_str_in_output
        # the prompt tail is context only: the first output token decodes as it would in place
        self._stream = DecodeStream(new.prompt_tail, params.skip_special_tokens)
        stops = tuple(s for s in params.stop if s)
        self._stop = StopMatcher(stops, params.include_stop_str_in_output) if stops else None
        self._undecoded: list[int] = []  # ids in the stream whose text is not out (partial UTF-8)
        self._unsent: list[int] = []  # ids of steps that produced no delta

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
        stream, tokenizer, stop = self._stream, self._tokenizer, self._stop
        if stop is None:
            if num_text <= 0:
                return "", len(ids)
            piece = stream.step(tokenizer, ids[0] if num_text == 1 else ids[:num_text])
            if piece is None:
                self._undecoded.extend(ids[:num_text])
                return "", len(ids)
            if self._undecoded:
                self._undecoded = []
            return piece, len(ids)
        parts: list[str] = []
        for j in range(num_text):  # one by one: the token that completes a stop string counts
            piece = stream.step(tokenizer, ids[j])
            if piece is None:
                self._undecoded.append(ids[j])
                continue
            if self._undecoded:
                self._undecoded = []
            parts.append(stop.feed(piece))
            if stop.hit:
                self.stop_hit = True
                return "".join(parts), j + 1
        return "".join(parts), len(ids)

    def _flush(self) -> str:
        """Text still inside the request when the core ends it."""
        text = ""
        if self._undecoded:  # bytes that never became a whole character: U+FFFD, as decode()
            text = self._tokenizer.decode(self._undecoded, skip_special_tokens=self._skip_special)
            self._undecoded = []
        if self._stop is None:
            return text
        out = self._stop.feed(text) if text else ""
        if self._stop.hit:
            self.stop_hit = True
            return out
        return out + self._stop.flush()
