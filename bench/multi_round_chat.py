"""Multi-round chat workload for bench/rag_cluster.py (like production-stack's and LMCache's multi-round QA).

Every user shares one system prompt (~`system_tokens`), brings a history of its own (~`history_tokens`:
notes from an earlier conversation), joins `join_interval_s` after the previous user, then asks
`rounds` questions one after the other (closed loop): each round's prompt is the whole conversation so
far, so the history grows by a question and an `answer_tokens` answer per round. Text comes from the
demo corpus, seeded; token counts are approximate (about 0.75 words a token), the report uses usage.
"""

from __future__ import annotations

import asyncio
import random
import time
from contextvars import ContextVar
from dataclasses import dataclass, field

import httpx

from ragserve.demo.client import ChatResult, stream_chat
from ragserve.demo.corpus import Document

WORDS_PER_TOKEN = 0.75
SYSTEM_HEAD = (
    "You are the support assistant of a hardware shop. Answer from the product notes below and the "
    "customer's earlier conversation. Be brief and precise; say so when the notes do not cover a question.\n\n"
    "Product notes:\n"
)


ROUTE: ContextVar[dict | None] = ContextVar("route", default=None)  # the running request's routing headers


async def _note_route(resp: httpx.Response) -> None:
    if (box := ROUTE.get()) is not None:
        box["reason"] = resp.headers.get("x-ragserve-route-reason", "")
        ms = resp.headers.get("x-ragserve-predicted-ttft-ms")
        box["predicted_ttft_s"] = int(ms) / 1000 if ms else None


def bench_client() -> httpx.AsyncClient:
    """A client that notes each response's routing reason and kv_aware's predicted TTFT (router headers)."""
    return httpx.AsyncClient(timeout=httpx.Timeout(900, connect=10), event_hooks={"response": [_note_route]})


async def routed_chat(http: httpx.AsyncClient, url: str, body: dict, headers: dict | None = None):
    """stream_chat through bench_client(); returns the result and what the router said about its route."""
    box: dict = {}
    ROUTE.set(box)  # this task's own context: concurrent requests do not see it
    return await stream_chat(http, url, body, headers), box


@dataclass
class ChatTurn:
    user: int
    round: int
    start_s: float = 0.0  # perf_counter when sent
    route: dict = field(default_factory=dict)  # router's reason and predicted TTFT

    @property
    def first(self) -> bool:  # the user's first request: nothing of its history was seen yet
        return self.round == 0


@dataclass
class ChatUser:
    index: int
    join_s: float
    history: str
    questions: list[str] = field(default_factory=list)


def _words(passages, n: int, rng: random.Random) -> str:
    out: list[str] = []
    pool = list(passages)
    rng.shuffle(pool)
    while len(out) < n:
        for p in pool:
            out += p.text.split()
            if len(out) >= n:
                break
    return " ".join(out[:n])


def system_prompt(docs: list[Document], tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    passages = [p for d in docs for p in d.passages]
    return SYSTEM_HEAD + _words(passages, int(tokens * WORDS_PER_TOKEN), rng)


def make_users(docs: list[Document], users: int, rounds: int, history_tokens: int, join_s: float, seed: int):
    rng = random.Random(seed + 1)
    out = []
    for i in range(users):
        doc = docs[i % len(docs)]
        notes = _words(doc.passages, int(history_tokens * WORDS_PER_TOKEN), rng)
        history = f"Customer {i} here. My notes from our last conversation about {doc.title}: {notes}"
        picks = [rng.choice(doc.passages) for _ in range(rounds)]
        questions = [f"Round {r}: what does the part starting '{' '.join(p.text.split()[:8])}' mean for me?"
                     for r, p in enumerate(picks)]  # fmt: skip
        out.append(ChatUser(i, i * join_s, history, questions))
    return out


async def run_chat(url: str, model: str, system: str, users: list[ChatUser], answer_tokens: int):
    """Every user's rounds, users concurrently; returns [(ChatTurn, ChatResult)] in completion order."""
    results: list[tuple[ChatTurn, ChatResult]] = []

    async def user_loop(http: httpx.AsyncClient, user: ChatUser) -> None:
        await asyncio.sleep(user.join_s)
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": user.history},
            {"role": "assistant", "content": "Thanks, I have your notes. What would you like to know?"},
        ]
        for r, question in enumerate(user.questions):
            messages.append({"role": "user", "content": question})
            body = {"model": model, "messages": messages, "max_tokens": answer_tokens}
            body.update(temperature=0.0, ignore_eos=True)
            start = time.perf_counter()
            result, route = await routed_chat(http, url, body)
            results.append((ChatTurn(user.index, r, start, route), result))
            messages.append({"role": "assistant", "content": result.text or "(no answer)"})

    async with bench_client() as http:
        await asyncio.gather(*(user_loop(http, u) for u in users))
    return results
