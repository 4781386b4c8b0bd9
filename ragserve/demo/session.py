"""One demo run: load the corpus, embed it, then ask each question with its retrieved context."""

from __future__ import annotations

import argparse

import httpx
from rich.console import Console
from rich.progress import Progress

from ragserve.demo.client import check_json_answer, json_answer, rag_messages, stream_chat
from ragserve.demo.corpus import CORPUS_DIR, load_corpus
from ragserve.demo.questions import QUESTIONS
from ragserve.demo.report import Answered, show_answer, show_summary

LOCAL = "local"  # --embedding-model local: embed in the demo's process, not through /v1/embeddings


class DemoSession:
    def __init__(
        self, console: Console, client: httpx.AsyncClient, url: str, model: str, args: argparse.Namespace
    ) -> None:
        self.console, self.client, self.url, self.model, self.args = console, client, url, model, args

    def _embedder(self):
        from ragserve.demo.embed import Embedder, RemoteEmbedder

        if self.args.embedding_model != LOCAL:
            return RemoteEmbedder(self.url, self.args.embedding_model, dict(self.client.headers), self.args.timeout)
        with self.console.status("loading all-MiniLM-L6-v2 (offline)"):
            return Embedder()

    def _retriever(self):
        from ragserve.demo.retrieve import Retriever

        docs = load_corpus(self.args.corpus or CORPUS_DIR)
        embedder = self._embedder()
        total = sum(len(d.passages) for d in docs)
        with Progress(console=self.console, transient=True) as progress:
            task = progress.add_task(f"embedding {total} passages of {len(docs)} documents", total=total)
            retriever = Retriever(docs, embedder, progress=lambda n: progress.advance(task, n))
        self.console.print(f"corpus: {len(docs)} documents, {total} passages; model {self.model} at {self.url}")
        embedding = self.args.embedding_model
        where = "in this process" if embedding == LOCAL else "via /v1/embeddings"
        self.console.print(f"embeddings: {embedding} {where}")
        return retriever

    async def run(self) -> list[Answered]:
        retriever = self._retriever()
        asked = self.args.question
        questions = [asked] if isinstance(asked, str) else asked or [q for q, _ in QUESTIONS]
        seen: set[str] = set()
        answered = []
        for i, question in enumerate(questions, 1):
            context = retriever.context(question, self.args.top_k, self.args.context)
            body = {
                "model": self.model,
                "messages": rag_messages(context.title, context.text, question, context.chunks),
                "max_tokens": self.args.max_tokens,
                "temperature": self.args.temperature,
            }
            json_mode = getattr(self.args, "json_answer", False)  # docs/api.md#structured-outputs
            if json_mode:
                hint, body["response_format"], body["max_tokens"] = json_answer(context.passage_ids, body["max_tokens"])
                body["messages"][0]["content"] += f"\n\n{hint}"
            result = await stream_chat(self.client, self.url, body, {"X-Context-Hash": context.hash})
            a = Answered(i, question, context, context.hash in seen, result)
            if json_mode and result.ok:
                a.json_answer, result.error = check_json_answer(result.text, context.passage_ids)
            seen.add(context.hash)
            show_answer(self.console, a)
            answered.append(a)
        show_summary(self.console, answered)
        return answered
