"""What the frontend and the runner share about grammars (llguidance): the tokenizer view, the
parser limits that bound compile and per-token work, and JSON schemas as grammars.

The frontend compiles and checks every grammar before a request reaches the engine; the runner
compiles the same text again (cached) for its matchers.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

# why these limits: they bound the work a pathological schema can cost. Lexer fuel runs at about
# 50k/ms to build (20 ms) and 14k/ms per token (at most ~4 ms a step); the rest are llguidance's
# defaults made explicit.
INITIAL_LEXER_FUEL = 1_000_000
STEP_LEXER_FUEL = 50_000
MAX_GRAMMAR_SIZE = 200_000


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(
        initial_lexer_fuel=INITIAL_LEXER_FUEL,
        step_lexer_fuel=STEP_LEXER_FUEL,
        max_grammar_size=MAX_GRAMMAR_SIZE,
    )


def make_tokenizer(
    tokenizer_json: str, vocab_size: int, eos: tuple[int, ...]
) -> llguidance.LLTokenizer:
    """llguidance's view of the model's tokenizer (~0.2 s for a 49k vocabulary: build once)."""
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos))


def json_grammar(schema: dict[str, Any] | bool, *, strict: bool) -> str:
    """A grammar for compact JSON (no whitespace between tokens) matching schema. strict: a
    keyword llguidance does not implement is an error; otherwise it is ignored (the rest of
    the schema still holds)."""
    options = {"whitespace_flexible": False, "lenient": not strict}
    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)


def check_grammar(grammar: str, tokenizer: llguidance.LLTokenizer) -> str:
    """ "" if the grammar compiles within the limits, else why not."""
    return llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=parser_limits())
