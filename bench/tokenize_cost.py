"""CPU per prompt of the tokenization every routed request pays (router) and every served one (engine, sims):
PromptTokenizer.encode (encode_batch_fast: ids only) against Tokenizer.encode(...).ids (ids plus character
offsets), on a RAG chat prompt (a document as context, a question), interleaved, median of --repeats.

    flock /tmp/cpu.lock .venv/bin/python bench/tokenize_cost.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cpu_ms(f, calls: int) -> float:
    t0 = time.process_time()
    for _ in range(calls):
        f()
    return 1000 * (time.process_time() - t0) / calls


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--doc-chars", type=int, default=14000)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    from report import provenance, write

    from ragserve.tokenizer import PromptTokenizer
    from tests.helpers.tiny_models import tiny_model

    tok = PromptTokenizer.from_dir(tiny_model("llama"))  # SmolLM2's tokenizer
    doc = (ROOT / "docs" / "architecture.md").read_text()[: args.doc_chars]
    messages = [
        {"role": "system", "content": "Answer from the context."},
        {"role": "user", "content": f"Context:\n{doc}\n\nQuestion: what does the router do?"},
    ]
    text = tok.render_chat(messages)
    ways = {
        "Tokenizer.encode(...).ids": lambda: tok.tokenizer.encode(text, add_special_tokens=False).ids,
        "PromptTokenizer.encode (encode_batch_fast)": lambda: tok.encode(text, add_special_tokens=False),
    }
    assert len({tuple(f()) for f in ways.values()}) == 1, "the two ways disagree"
    runs: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(args.repeats):
        for name, f in ways.items():
            runs[name].append(cpu_ms(f, args.calls))
    report = {
        **provenance("tokenize_cost.py"),
        "prompt_tokens": len(tok.encode(text, add_special_tokens=False)),
        "median_cpu_ms": {k: statistics.median(v) for k, v in runs.items()},
        "runs": runs,
    }
    lines = [
        "# Tokenizing a RAG chat prompt",
        "",
        f"Command: `{report['command']}` at {report['commit']}, {report['date']}: {report['prompt_tokens']} tokens "
        f"(SmolLM2's tokenizer), CPU ms per prompt, median of {args.repeats} interleaved repeats of {args.calls} "
        "calls; both ways give the same ids.",
        "",
        "| way | CPU ms / prompt | each repeat |",
        "|---|---:|---|",
    ]
    for name, ms in report["median_cpu_ms"].items():
        lines.append(f"| {name} | {ms:.2f} | {', '.join(f'{x:.2f}' for x in runs[name])} |")
    write(args.out, "tokenize_cost", report, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
