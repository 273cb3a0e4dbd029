from __future__ import annotations

import random

import pytest

from gapless.detokenizer.stop import StopMatcher


def run(stops: tuple[str, ...], pieces: list[str], include: bool = False) -> tuple[list[str], bool]:
    matcher = StopMatcher(stops, include)
    out = []
    for piece in pieces:
        out.append(matcher.feed(piece))
        if matcher.hit:
            return out, True
    out.append(matcher.flush())
    return out, False


def test_holds_back_a_possible_start_and_releases_it_when_it_is_not():
    matcher = StopMatcher(("STOP",), include=False)
    assert matcher.feed("go ST") == "go "
    assert matcher.feed("O") == ""
    assert matcher.feed("P") == ""
    assert matcher.hit


def test_false_start_is_released():
    matcher = StopMatcher(("STOP",), include=False)
    assert matcher.feed("a ST") == "a "
    assert matcher.feed("OX") == "STOX"
    assert not matcher.hit
    assert matcher.feed("S") == ""
    assert matcher.flush() == "S"
    assert matcher.flush() == ""


def test_nested_partial_restarts():
    # "aab" is held as "aa" then "a" stays a possible start after the first one fails
    out, hit = run(("aab",), ["xa", "a", "a", "b", "tail"])
    assert hit and "".join(out) == "xa"


def test_include_stop_string_releases_at_once_and_cuts_after_it():
    matcher = StopMatcher(("END",), include=True)
    assert matcher.feed("the E") == "the E"
    assert matcher.feed("ND and more") == "ND"
    assert matcher.hit


def test_earliest_stop_wins_within_a_chunk():
    out, hit = run(("world", "lo"), ["hello world"])
    assert hit and out == ["hel"]


@pytest.mark.parametrize("include", [False, True])
def test_random_chunkings_match_a_plain_search(include: bool):
    rng = random.Random(0)
    alphabet = "ab c\n"
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = tuple(
            {"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in "xy"}
        )
        if any(s != t and s in t for s in stops for t in stops):
            continue  # nested stops: which one wins depends on chunking, by design
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 8))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        found = [(text.find(s), s) for s in stops if s in text]
        if found:
            i, s = min(found)
            want = text[: i + len(s)] if include else text[:i]
        else:
            want = text
        out, hit = run(stops, pieces, include)
        assert hit == bool(found)
        assert "".join(out) == want, (text, stops, pieces)


def test_held_back_suffix_is_the_longest_start_of_a_stop():
    rng = random.Random(1)
    alphabet = "ab c\n"
    for _ in range(5000):
        stops = tuple({"".join(rng.choices(alphabet, k=rng.randint(1, 5))) for _ in "xyz"})
        buf = "".join(rng.choices(alphabet, k=rng.randint(0, 12)))
        keep = max(map(len, stops)) - 1
        want = next(
            (
                k
                for k in range(min(keep, len(buf)), 0, -1)
                if any(s.startswith(buf[len(buf) - k :]) for s in stops)
            ),
            0,
        )
        assert StopMatcher(stops, include=False)._partial(buf) == want, (buf, stops)
