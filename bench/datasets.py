"""Readers of ShareGPT-format and LooGLE-like JSON files: (prompt, reference answer) pairs."""

from __future__ import annotations

import json
from pathlib import Path


def _records(path: str | Path) -> list:
    text = Path(path).read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:  # JSON lines
        data = [json.loads(line) for line in text.splitlines() if line.strip()]
    if isinstance(data, dict):
        data = data.get("data") or data.get("rows") or [data]
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of records")
    return data


def read_sharegpt(path: str | Path) -> list[tuple[str, str]]:
    """First human turn and the gpt answer right after it, per conversation that has both."""
    pairs = []
    for item in _records(path):
        turns = item.get("conversations") or item.get("conversation") or []
        for first, second in zip(turns, turns[1:], strict=False):
            if first.get("from") == "human" and second.get("from") == "gpt":
                if first.get("value") and second.get("value"):
                    pairs.append((first["value"], second["value"]))
                break
    if not pairs:
        raise ValueError(f"{path}: no human/gpt turn pairs found (ShareGPT format expected)")
    return pairs


def read_loogle(path: str | Path) -> list[tuple[str, str]]:
    """Document + question as the prompt, the answer as reference; LooGLE's `input`,
    `question`/`qa_pairs` and `answer`/`output` fields (or `context`/`document`)."""
    pairs = []
    for item in _records(path):
        doc = item.get("input") or item.get("context") or item.get("document") or ""
        qa = item.get("qa_pairs")
        if isinstance(qa, str):
            try:
                qa = json.loads(qa)
            except json.JSONDecodeError:
                qa = None
        if isinstance(qa, list) and qa:
            question, answer = qa[0].get("Q", ""), qa[0].get("A", "")
        else:
            question = item.get("question", "")
            answer = item.get("answer") or item.get("output") or ""
        if doc and answer:
            pairs.append((f"{doc}\n\nQuestion: {question}\nAnswer:", str(answer)))
    if not pairs:
        raise ValueError(f"{path}: no document/answer records found")
    return pairs
