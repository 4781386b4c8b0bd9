"""The demo corpus: markdown documents split into passages (paragraphs merged up to a word budget)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

CORPUS_DIR = Path(__file__).resolve().parent.parent / "data" / "corpus"
PASSAGE_WORDS = 120


@dataclass(frozen=True)
class Passage:
    id: str  # "<doc id>#<index>"
    doc_id: str
    index: int
    text: str


@dataclass
class Document:
    id: str  # file stem
    title: str
    text: str
    passages: list[Passage] = field(default_factory=list)


def load_corpus(directory: Path | str = CORPUS_DIR, passage_words: int = PASSAGE_WORDS) -> list[Document]:
    """Every *.md file of directory, sorted by name, with its passages."""
    directory = Path(directory)
    files = sorted(directory.glob("*.md"))
    if not files:
        raise FileNotFoundError(f"no *.md documents in {directory}")
    docs = []
    for path in files:
        text = path.read_text(encoding="utf-8").strip()
        title = next((line[2:].strip() for line in text.splitlines() if line.startswith("# ")), path.stem)
        docs.append(Document(path.stem, title, text, split_passages(path.stem, text, passage_words)))
    return docs


def split_passages(doc_id: str, text: str, words: int = PASSAGE_WORDS) -> list[Passage]:
    """Greedy: whole paragraphs until the budget is reached; a heading always starts a passage."""
    chunks: list[list[str]] = [[]]
    size = 0
    for para in (p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()):
        n = len(para.split())
        heading = para.startswith("#")
        if chunks[-1] and (heading or size + n > words):
            chunks.append([])
            size = 0
        chunks[-1].append(para)
        size += n
    return [Passage(f"{doc_id}#{i}", doc_id, i, "\n\n".join(c)) for i, c in enumerate(chunks) if c]
