"""Rich output of the demo: one block per answered question, then a summary table."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from ragserve.demo.client import ChatResult
from ragserve.demo.retrieve import Context


@dataclass
class Answered:
    index: int
    question: str
    context: Context
    repeated: bool  # this context was sent before in this run
    result: ChatResult
    json_answer: dict | None = None  # --json-answer: the parsed answer

    def to_dict(self) -> dict:
        return {
            "index": self.index,
            "question": self.question,
            "documents": self.context.doc_ids,
            "passages": self.context.passage_ids,
            "json_answer": self.json_answer,
            "context_hash": self.context.hash,
            "repeated_context": self.repeated,
            **self.result.to_dict(),
        }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def show_answer(console: Console, a: Answered) -> None:
    r = a.result
    tag = "[yellow]repeated context[/]" if a.repeated else "[cyan]first sight[/]"
    console.print(f"\n[bold]Q{a.index}[/] {a.question}  ({tag})")
    console.print(f"  context: {a.context.title} [dim]({', '.join(a.context.doc_ids)})[/]", highlight=False)
    if not r.ok:
        console.print(f"  [red]failed (HTTP {r.status or '-'}): {r.error}[/]")
        return
    share = f" ({100 * r.cached_tokens / r.prompt_tokens:.0f}%)" if r.prompt_tokens else ""
    console.print(
        f"  engine [bold]{r.engine or '?'}[/]  prompt {r.prompt_tokens} tok  cached [green]{r.cached_tokens}[/] tok"
        f"{share}  TTFT {_ms(r.ttft_s)}  total {r.latency_s:.2f} s",
        highlight=False,
    )
    if a.json_answer is not None:
        console.print(f"  answer: {' '.join(a.json_answer['answer'].split())}", highlight=False)
        console.print(f"  cites: {', '.join(a.json_answer['cited_passages']) or '-'}", highlight=False)
        return
    console.print(f"  answer: {' '.join(r.text.split())}", highlight=False)


def show_summary(console: Console, answered: list[Answered]) -> None:
    table = Table(title="ragserve demo", show_lines=False)
    for col in ("#", "document", "context", "engine", "prompt", "cached", "TTFT"):
        table.add_column(col, justify="right" if col in ("#", "prompt", "cached", "TTFT") else "left")
    for a in answered:
        r = a.result
        table.add_row(
            str(a.index),
            ", ".join(a.context.doc_ids),
            "repeat" if a.repeated else "first",
            r.engine if r.ok else f"[red]HTTP {r.status or '-'}[/]",
            str(r.prompt_tokens),
            str(r.cached_tokens),
            _ms(r.ttft_s),
        )
    console.print()
    console.print(table)
    ok = [a.result for a in answered if a.result.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    if prompt:
        console.print(f"prompt tokens served from cache: {cached}/{prompt} ({100 * cached / prompt:.0f}%)")
    for label, repeated in (("first sight", False), ("repeated context", True)):
        ttfts = sorted(a.result.ttft_s for a in answered if a.result.ok and a.repeated == repeated and a.result.ttft_s)
        if ttfts:
            console.print(f"median TTFT, {label}: {_ms(ttfts[len(ttfts) // 2])} over {len(ttfts)} question(s)")
