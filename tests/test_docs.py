"""Cheap guards on the prose: the architecture map stays short, every path and section the docs
name exists, and bench/RESULTS.md, the one home of measured figures, keeps its shape (dated
sections, newest first, each naming its machine and its command)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "RESULTS.md"
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", RESULTS]
CODE = ("common", "shm", "frontend", "core", "detokenizer", "gpu_runner", "launch", "bench")
MAX_ARCHITECTURE_LINES = 420

# a relative path with a folder, ending .md or .py: `docs/cpu.md`, tests/test_layout.py
PATH = re.compile(r"(?<![\w/.<~$-])((?:[\w.-]+/)+[\w-]+\.(?:md|py))\b")
LINK = re.compile(r"\]\(([^)\s]+)\)")
MODULE = re.compile(r"python3? -m (gapless(?:\.\w+)+)")
# a section named after its document: docs/cpu.md, "Threads"; RESULTS.md ("tenants: ...")
SECTION_REF = re.compile(r"([\w./-]+\.md)[,\s(]*\"([^\"]{2,200})\"")
HEADING = re.compile(r"^#{1,6} (.+)$", re.M)
LEAD_IN = re.compile(r"^(?:- |\d+\. )?\*\*([^*]+)\*\*", re.M)
# bench/RESULTS.md: `## 2026-11-27: title` or `## 2026-11-22 to 2026-11-27: title`
DATED = re.compile(r"^## (\d{4}-\d\d-\d\d)(?: to (\d{4}-\d\d-\d\d))?: (.+)$")
UNDATED = ("Index", "How to add figures")


def _norm(text: str) -> str:
    """One line, lower case, no comment markers left by a wrapped code comment."""
    lines = [re.sub(r"^\s*(#|//|\*)?\s*", "", line) for line in text.splitlines()]
    return " ".join(" ".join(lines).split()).lower()


def _titles(doc: Path) -> list[str]:
    """What a reference may name in a document: its headings (without a leading date) and
    the bold lead-ins of its paragraphs and list items."""
    text = doc.read_text()
    heads = [re.sub(r"^[\d-]+(?: to [\d-]+)?: ", "", h) for h in HEADING.findall(text)]
    return [_norm(t.strip(" .:")) for t in heads + LEAD_IN.findall(text)]


def _resolve(name: str, near: Path) -> Path | None:
    for base in (ROOT, near.parent):
        if (base / name).exists():
            return base / name
    return None


def test_the_architecture_map_is_short():
    lines = (ROOT / "docs" / "architecture.md").read_text().count("\n")
    assert lines <= MAX_ARCHITECTURE_LINES, f"docs/architecture.md has {lines} lines"


def test_every_path_and_link_in_the_docs_exists():
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        for name in PATH.findall(text):
            if _resolve(name, doc) is None:
                missing.append(f"{doc.relative_to(ROOT)}: {name}")
        for target in LINK.findall(text):
            target = target.split("#")[0]
            if target and "://" not in target and _resolve(target, doc) is None:
                missing.append(f"{doc.relative_to(ROOT)}: link {target}")
        for module in MODULE.findall(text):
            rel = Path(*module.split(".")[1:])
            if not (
                (ROOT / rel).with_suffix(".py").exists() or (ROOT / rel / "__main__.py").exists()
            ):
                missing.append(f"{doc.relative_to(ROOT)}: python -m {module}")
    assert missing == []


def _section_refs(files: list[Path]) -> list[str]:
    wrong = []
    for f in files:
        for name, title in SECTION_REF.findall(f.read_text()):
            doc = _resolve(name, f)
            if doc is None or doc.suffix != ".md":
                continue
            if not any(_norm(title).strip(" .:") in t for t in _titles(doc)):
                wrong.append(f'{f.relative_to(ROOT)}: {name}, "{_norm(title)}"')
    return wrong


def test_every_section_the_docs_name_exists():
    assert _section_refs(DOCS) == []


def test_every_section_code_comments_name_exists():
    files = [p for pkg in CODE for p in (ROOT / pkg).rglob("*") if p.suffix in (".py", ".cpp")]
    assert len(files) > 100 and _section_refs(files) == []


def test_results_sections_are_dated_newest_first_with_machine_and_command():
    text = RESULTS.read_text()
    sections = re.split(r"^(?=## )", text, flags=re.M)[1:]
    dates, wrong = [], []
    for section in sections:
        heading, body = section.split("\n", 1)
        if heading[3:] in UNDATED:
            continue
        m = DATED.match(heading)
        if not m:
            wrong.append(f"heading not `## YYYY-MM-DD: title`: {heading}")
            continue
        dates.append(m.group(1))
        for label in ("Machine", "Command"):
            if not re.search(rf"^{label}s?: \S", body, re.M):
                wrong.append(f"{heading}: no `{label}:` line")
    assert len(dates) > 10 and wrong == []
    assert dates == sorted(dates, reverse=True), "sections newest first"


def test_results_index_lists_every_section():
    text = RESULTS.read_text()
    index = text.split("\n## Index\n", 1)[1].split("\n## ", 1)[0]
    headings = [h for h in re.findall(r"^## (.+)$", text, re.M) if h not in UNDATED]
    listed = [
        f"{d}: {t}" for d, t in re.findall(r"^- ([\d-]+(?: to [\d-]+)?): \[(.+?)\]", index, re.M)
    ]
    assert listed == headings
