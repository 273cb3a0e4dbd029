"""A nesting bound the server owns: JSON nested deeper than MAX_JSON_DEPTH is refused before a
parser sees it.

msgspec and Python's json bound their recursion by the interpreter's recursion limit, which
anything in the process may raise (hypothesis does while its tests run), and past the C stack a
deep enough document crashes the interpreter. So every JSON the frontend parses (a request body,
a tool call's `arguments` in a request, a tool call the model wrote) is measured here first, in
time linear in its size: a count of the opening brackets when there are few, else a few passes
in C (bytes methods, numpy) over the document.

Depth counts the arrays and objects open at once outside strings: `{}` is 1, `{"a": [1]}` is 2.
A `"` after an odd run of backslashes is not a quote, so escaped quotes do not end a string. On
invalid JSON this reads the bytes as a parser does up to its first error (a backslash outside a
string is such an error), so it still bounds how deep a parser gets before it gives up.
"""

from __future__ import annotations

import numpy as np

# why 128: an OpenAI body nests ~5 levels around a JSON schema, and a schema takes 2 levels per
# level of the data it describes; no real request comes near it
MAX_JSON_DEPTH = 128

_QUOTE = ord('"')
# every byte but `"[]{}`, which bytes.translate deletes
_NOT_MARKS = bytes(b for b in range(256) if b not in b'"[]{}')


def deeper_than(doc: bytes | str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether doc nests arrays and objects more than `limit` deep."""
    # why first: depth never exceeds the number of opening brackets, which C counts at memory
    # speed; only a document holding more of them than the limit gets the full pass
    if isinstance(doc, str):
        num_opening = doc.count("[") + doc.count("{")
    else:
        num_opening = doc.count(b"[") + doc.count(b"{")
    return num_opening > limit and json_depth(doc) > limit


def json_depth(doc: bytes | str) -> int:
    """How deep doc nests arrays and objects (module docstring)."""
    raw = doc.encode("utf-8", "surrogatepass") if isinstance(doc, str) else doc
    if b"\\" in raw:
        # escaped backslashes first, then escaped quotes: of a run of backslashes before a
        # quote one is left if the run was odd, and that quote goes with it
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    marks = np.frombuffer(raw.translate(None, _NOT_MARKS), np.uint8)  # [k] only `"[]{}`
    # `[` 0x5B and `{` 0x7B have bit 0x02 set, `]` 0x5D and `}` 0x7D do not
    step = (marks & 2).view(np.int8) - 1  # [k] +1 opens, -1 closes
    is_quote = marks == _QUOTE
    if is_quote.any():  # quotes and what lies after an odd number of them do not count
        step[is_quote | (np.cumsum(is_quote, dtype=np.int32) & 1 == 1)] = 0
    return int(np.cumsum(step, dtype=np.int32).max(initial=0))
