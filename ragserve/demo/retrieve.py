"""Dense retrieval over passages, and the context a question is answered from.

Context modes:
- `parent` (default, "small-to-big"): passages are ranked, and the whole document of the best
  passage is the context. Every question about one document then sends the same context, so
  its KV cache is computed once and reused (the point of ragserve).
- `passages`: the top-k passages themselves, in corpus order (so the same set is the same prompt).
- `chunks`: the top-k passages in rank order, each sent as a chunk (docs/blend.md): the engine reuses
  each passage's KV wherever it appears, so any set and order of passages is cheap.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from ragserve.demo.corpus import Document, Passage
from ragserve.demo.embed import cached_encode

CONTEXT_MODES = ("parent", "passages", "chunks")


@dataclass
class Context:
    doc_ids: list[str]
    passage_ids: list[str]
    title: str
    text: str
    chunks: list[str] = field(default_factory=list)  # `chunks` mode: each passage apart

    @property
    def hash(self) -> str:
        """Identity of the retrieved context, for the router's prefix policy (X-Context-Hash)."""
        return context_hash(self.passage_ids)


def context_hash(passage_ids: list[str]) -> str:
    return hashlib.sha256(",".join(sorted(passage_ids)).encode()).hexdigest()[:32]


def document_context(doc: Document) -> Context:
    return Context([doc.id], [p.id for p in doc.passages], doc.title, doc.text)


class Retriever:
    def __init__(self, docs: list[Document], embedder, progress=None) -> None:
        self.docs = {d.id: d for d in docs}
        self.passages: list[Passage] = [p for d in docs for p in d.passages]
        self.embedder = embedder
        self.vectors = cached_encode(embedder, [p.text for p in self.passages], progress=progress)

    def search(self, question: str, k: int) -> list[tuple[Passage, float]]:
        query = self.embedder.encode([question])[0]
        scores = self.vectors @ query
        top = np.argsort(-scores, kind="stable")[:k]
        return [(self.passages[i], float(scores[i])) for i in top]

    def context(self, question: str, k: int = 4, mode: str = "parent") -> Context:
        if mode not in CONTEXT_MODES:
            raise ValueError(f"context mode must be one of {CONTEXT_MODES}, got {mode!r}")
        hits = self.search(question, k)
        if mode == "parent":
            return document_context(self.docs[hits[0][0].doc_id])
        chosen = [p for p, _ in hits]
        if mode == "passages":
            chosen.sort(key=lambda p: self.passages.index(p))
        doc_ids = list(dict.fromkeys(p.doc_id for p in chosen))
        title = "; ".join(self.docs[d].title for d in doc_ids)
        chunks = [p.text for p in chosen] if mode == "chunks" else []
        return Context(doc_ids, [p.id for p in chosen], title, "\n\n".join(p.text for p in chosen), chunks)
