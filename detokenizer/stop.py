"""Stop strings over streamed text, with hold-back of what could still become one."""

from __future__ import annotations


class StopMatcher:
    """Scans text chunks in order for the stop strings of one request.

    `feed` returns the text that may be released now. Without include_stop_str_in_output, the
    longest suffix that is a proper prefix of some stop string is held back until the next chunk
    shows whether it completes one; with it, nothing is held back (the stop string would be sent
    anyway) and only the text after a completed stop string is cut.
    """

    __slots__ = ("stops", "include", "hit", "_firsts", "_keep", "_tail", "_held")

    def __init__(self, stops: tuple[str, ...], include: bool) -> None:
        assert stops and all(stops), "stop strings must be non-empty"
        self.stops = stops
        self.include = include
        self.hit = False  # a stop string completed; feed must not be called again
        self._firsts = frozenset(s[0] for s in stops)
        self._keep = max(len(s) for s in stops) - 1  # chars of context a match may still need
        self._tail = ""  # the last <= _keep chars seen
        self._held = 0  # how many chars at the end of _tail are not released yet

    def feed(self, text: str) -> str:
        tail = self._tail
        buf = tail + text
        start = len(tail) - self._held  # first char of buf not released yet
        first = end = -1
        for s in self.stops:
            # matches that end inside the old tail were already looked for
            i = buf.find(s, max(0, len(tail) - len(s) + 1))
            if i >= 0 and (first < 0 or i < first):
                first, end = i, i + len(s)
        if first >= 0:
            self.hit = True
            self._tail, self._held = "", 0
            return buf[start : end if self.include else first]
        held = 0 if self.include else self._partial(buf)
        self._held = held
        self._tail = buf[max(0, len(buf) - self._keep) :] if self._keep else ""
        return buf[start : len(buf) - held]

    def flush(self) -> str:
        """Release the held-back text: the stream ended, so it is not a stop string."""
        held, self._held = self._held, 0
        return self._tail[len(self._tail) - held :] if held else ""

    def _partial(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        n = len(buf)
        low = max(0, n - self._keep)
        best = 0
        for first in self._firsts:  # why: find() skips the chars that start no stop string
            i = buf.find(first, low)
            while 0 <= i < n - best:  # a suffix from i would be longer than the best so far
                suffix = buf[i:]
                if any(s.startswith(suffix) for s in self.stops):
                    best = n - i
                    break
                i = buf.find(first, i + 1)
        return best
