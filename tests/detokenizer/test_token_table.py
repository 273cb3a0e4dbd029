from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from gapless.detokenizer.state import DetokenizerState, Outbox
from gapless.detokenizer.token_table import TokenTable
from tests.detokenizer.util import ASSISTANT_TAIL, EOS, make_batch, make_new

TEXTS = [
    "Hello 世界! 🎉🎉 naïve café — 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "日本語のテキストを分割する。한국어도 있어요. 東京 sleeps under 🌙 light.",
    "family: 👩‍👩‍👧‍👦, flags 🇫🇷🇯🇵, skin 👍🏽, e\u0301 and \u200b",
    "  leading spaces\n\ttabs, and a \ufffd typed in the text\ufffd",
    "<|im_start|>assistant\nspecials<|im_end|> inside the text<|endoftext|>",
    "<tool> is added but not special, <s> and </s> are",
]
STOPS = ["東", "🌙", " the", "s", "\n", "👍🏽", "é", "<|im_end|>", "\ufffd"]
ENDS = ["length", "stop_token", "abort", "error", "queue_timeout"]


def _reference(tokenizer: Tokenizer) -> DetokenizerState:
    """Every request of this state decodes with its DecodeStream alone."""
    state = DetokenizerState(tokenizer)
    state._table = None
    return state


def _ids(tokenizer: Tokenizer, rng: random.Random) -> list[int]:
    """A token sequence: a text's tokens or a slice of them (which may start or end inside a
    character), or ids drawn at random from the texts, the specials and the whole vocabulary."""
    ids = tokenizer.encode(rng.choice(TEXTS)).ids
    kind = rng.randrange(4)
    if kind == 0:
        return ids
    if kind == 1:
        start = rng.randrange(len(ids))
        return ids[start : start + rng.randrange(1, 40)]
    pool = [t for text in TEXTS for t in tokenizer.encode(text).ids] + list(range(17))
    if kind == 3:  # unknown ids too
        pool += [rng.randrange(tokenizer.get_vocab_size() + 8) for _ in range(20)]
    return [rng.choice(pool) for _ in range(rng.randrange(1, 40))]


def _request(tokenizer: Tokenizer, rng: random.Random) -> tuple[dict, list[list[int]], str]:
    """(make_new keywords, the steps' tokens, the end reason of the last step)."""
    ids = _ids(tokenizer, rng)
    tails = [ASSISTANT_TAIL, [], [1, 0], _ids(tokenizer, rng)[-4:]]
    new = {"prompt_tail": rng.choice(tails), "skip_special_tokens": rng.random() < 0.7}
    if rng.random() < 0.4:
        new["stop"] = tuple(rng.sample(STOPS, rng.randrange(1, 3)))
        new["include_stop_str_in_output"] = rng.random() < 0.5
    end = rng.choice(ENDS)
    if end == "stop_token":
        ids.append(EOS)
    steps, pos = [], 0
    while pos < len(ids):
        n = 1 if rng.random() < 0.7 else rng.randrange(2, 5)
        steps.append(ids[pos : pos + n])
        pos += n
    return new, steps, end


def _same_outputs(tokenizer: Tokenizer, rng: random.Random, num_requests: int) -> None:
    """Drives a state with the token table and a reference one with the same batches; both
    must give equal deltas, stop hits and failures at every step."""
    fast, ref = DetokenizerState(tokenizer), _reference(tokenizer)
    requests = [_request(tokenizer, rng) for _ in range(num_requests)]
    for r, (new, _, _) in enumerate(requests):
        fast.add(make_new(f"r{r}", frontend_id=r % 3, **new))
        ref.add(make_new(f"r{r}", frontend_id=r % 3, **new))
    for k in range(max(len(steps) for _, steps, _ in requests)):
        entries = [
            (f"r{r}", steps[k], end if k == len(steps) - 1 else "")
            for r, (_, steps, end) in enumerate(requests)
            if k < len(steps)
        ]
        # an errors list sends every entry of the batch down the general step
        errors = ["boom" if e[2] == "error" else "" for e in entries]
        batch = make_batch(entries, errors=errors if rng.random() < 0.2 else None)
        outs = []
        for state in (fast, ref):
            out = Outbox()
            state.process(batch, out)
            outs.append(out)
        got, want = outs
        assert got.deltas == want.deltas, (k, entries)
        assert (got.stop_hits, got.failed) == (want.stop_hits, want.failed)
    assert fast.num_requests == ref.num_requests == 0


@pytest.fixture(scope="module")
def small_byte_level() -> Tokenizer:
    """A byte-level BPE trained on TEXTS: other merges than SmolLM2's (some CJK characters
    whole), special tokens, and an added token that is not special."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=["<s>", "</s>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TEXTS * 4, trainer)
    tokenizer.add_tokens([AddedToken("<tool>", special=False)])
    return tokenizer


@pytest.mark.parametrize("seed", range(25))
def test_table_gives_the_stream_deltas(tokenizer, seed: int):
    _same_outputs(tokenizer, random.Random(seed), num_requests=24)


@pytest.mark.parametrize("seed", range(10))
def test_table_gives_the_stream_deltas_on_another_vocabulary(small_byte_level, seed: int):
    assert TokenTable.of(small_byte_level) is not None
    _same_outputs(small_byte_level, random.Random(seed), num_requests=24)


def test_table_entries_match_decode(tokenizer):
    table = TokenTable.of(tokenizer)
    assert table is not None
    added = tokenizer.get_added_tokens_decoder()
    num_whole = 0
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text, data = table[token_id]
        alone = tokenizer.decode([token_id], skip_special_tokens=False)
        if token_id in added:
            assert (text, data) == ("", b"")
            continue
        assert data and data.decode(errors="replace") == alone
        assert text == ("" if "\ufffd" in alone else alone)
        num_whole += bool(text)
    assert num_whole > 0.9 * tokenizer.get_vocab_size()
    assert table[tokenizer.get_vocab_size() + 5] == ("", b"")
    assert table[-1] == ("", b"")


@pytest.mark.parametrize("text", TEXTS[:4])
def test_table_bytes_join_to_the_text(tokenizer, text: str):
    table = TokenTable.of(tokenizer)
    assert table is not None
    ids = tokenizer.encode(text).ids
    assert table.bytes_of(ids).decode() == tokenizer.decode(ids) == text
    assert table.bytes_of([*ids, EOS]) == b""  # an added token is left to the stream


def test_split_character_waits_for_its_last_byte(tokenizer):
    ids = tokenizer.encode(" 東京🌙").ids
    assert len(ids) > 3  # byte pieces: the table holds them back as the stream does
    state = DetokenizerState(tokenizer)
    state.add(make_new())
    texts = []
    for token_id in ids:
        out = Outbox()
        state.process(make_batch([("r0", [token_id], "")]), out)
        texts += [d.text for ds in out.deltas.values() for d in ds]
    assert "".join(texts) == " 東京🌙"
    assert all("\ufffd" not in t for t in texts)


def test_not_byte_level_decodes_with_the_stream():
    vocab = {"<unk>": 0, "▁the": 1, "▁cat": 2, "s": 3, "▁sat": 4}
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    assert TokenTable.of(tokenizer) is None
    state = DetokenizerState(tokenizer)
    state.add(make_new(prompt_tail=[]))
    ids = [1, 2, 3, 4]
    out = Outbox()
    for t in ids:
        state.process(make_batch([("r0", [t], "")]), out)
    assert "".join(d.text for d in out.deltas[0]) == tokenizer.decode(ids) == "the cats sat"
