"""CacheBlend on SmolLM2-135M: quality against full prefill, and TTFT (docs/blend.md).

Quality, for recompute fractions 0, 5, 15 and 30 % on two prompt sets (the demo corpus with its questions;
Python standard-library module docs with questions about them): first-token agreement, greedy-answer
exact match and ROUGE-L, and the mean next-token KL(full || blended) over the full prefill's answer
(teacher forced). TTFT: prompts of 3-6 documents of 200-500 tokens, reordered and recombined per
request, with a blended prefill (chunks stored by earlier requests) vs prefix caching alone vs full
prefill, on one engine (offline LLMEngine, one request at a time).

    python bench/blend.py [--prompts 12] [--requests 10] [--out bench/results/blend]
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import re
import statistics
import time
from pathlib import Path

import torch

from ragserve.chunks import ChunkedPrompt, encode_chunked_chat
from ragserve.demo.corpus import load_corpus
from ragserve.demo.questions import QUESTIONS
from ragserve_engine.blend.forward import blend_forward
from ragserve_engine.blend.spec import BlendSpec, Selection
from ragserve_engine.llm import LLM
from ragserve_engine.sampling_params import SamplingParams

FRACTIONS = (0.0, 0.05, 0.15, 0.30)
SYSTEM = "Answer the question using only the documents. Be brief."
STDLIB = [
    "re", "statistics", "csv", "argparse", "json", "http.client", "unittest", "heapq", "subprocess", "typing",
    "pdb", "doctest", "ftplib", "itertools", "sqlite3", "pydoc", "socket", "ssl", "hashlib", "struct", "copy",
    "smtplib", "uuid", "wave", "cmd", "timeit", "plistlib", "urllib.parse", "http.cookies", "configparser",
    "shelve", "turtle", "site", "io", "xmlrpc.client", "sched",
]  # fmt: skip


# ---- prompt sets ----------------------------------------------------------------------------
def corpus_docs(tokenizer) -> dict[str, list[str]]:
    """doc id -> its passages of 200-500 tokens."""
    docs = {}
    for d in load_corpus(passage_words=250):
        keep = [p.text for p in d.passages if 200 <= len(tokenizer.encode(p.text, add_special_tokens=False)) <= 500]
        if keep:
            docs[d.id] = keep
    return docs


def stdlib_docs(tokenizer) -> dict[str, list[str]]:
    """Module name -> its docstring in pieces of 200-500 tokens (a second, independent set)."""
    docs = {}
    for name in STDLIB:
        module = __import__(name, fromlist=["_"])
        paras = [p for p in re.split(r"\n\s*\n", inspect.getdoc(module) or "") if p.strip()]
        pieces, cur = [], ""
        for p in paras:
            cur = f"{cur}\n\n{p}" if cur else f"Python module {name}:\n{p}"
            if len(tokenizer.encode(cur, add_special_tokens=False)) >= 200:
                pieces.append(cur)
                cur = f"Python module {name} (continued):"
        pieces = [p for p in pieces if len(tokenizer.encode(p, add_special_tokens=False)) <= 500]
        if pieces:
            docs[name] = pieces
    return docs


def rag_messages(texts: list[str], question: str, chunks: bool = True) -> list[dict]:
    """The RAG chat: each document a content part, marked as a chunk unless chunks=False."""
    parts = [{"type": "text", "text": "Documents:\n"}]
    for text in texts:
        doc = {"type": "text", "text": text} | ({"ragserve_chunk": True} if chunks else {})
        parts += [doc, {"type": "text", "text": "\n\n"}]
    parts.append({"type": "text", "text": f"Question: {question}"})
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}]


def rag_prompt(tokenizer, texts: list[str], question: str) -> ChunkedPrompt:
    return encode_chunked_chat(tokenizer, rag_messages(texts, question))


def build(tokenizer, docs: dict[str, list[str]], question: str, target: str, rng: random.Random) -> ChunkedPrompt:
    """3-6 documents in random order, one from `target` (the one most like the question), then the question."""
    words = set(question.lower().split())
    best = max(docs[target], key=lambda t: len(words & set(t.lower().split())))
    others = [t for k, v in docs.items() if k != target for t in v]
    chosen = [best, *rng.sample(others, rng.randint(2, 5))]
    rng.shuffle(chosen)
    return rag_prompt(tokenizer, chosen, question)


def corpus_questions(docs: dict[str, list[str]], rng: random.Random) -> list[tuple[str, str]]:
    """The demo's questions, then one per section heading of the corpus (shuffled): (question, doc id)."""
    by_title = {d.id: d.title for d in load_corpus(passage_words=250)}
    sections = [
        (f'According to {by_title[doc]}, what does the section "{m.group(1)}" say?', doc)
        for doc, texts in sorted(docs.items())
        for t in texts
        if (m := re.match(r"#+ (.+)", t))
    ]
    rng.shuffle(sections)
    return [(q, d) for q, d in QUESTIONS if d in docs] + sections


def prompt_sets(tokenizer, n: int, seed: int) -> dict[str, list[ChunkedPrompt]]:
    """n prompts per set, each question once (a question repeats only when n exceeds them)."""
    rng = random.Random(seed)
    corpus, stdlib = corpus_docs(tokenizer), stdlib_docs(tokenizer)
    qs = corpus_questions(corpus, rng)
    sets = {"corpus": [build(tokenizer, corpus, q, d, rng) for q, d in (qs * n)[:n]]}
    names = sorted(stdlib)
    sets["stdlib"] = [
        build(tokenizer, stdlib, f"What is the Python {m} module for, and name one thing it provides?", m, rng)
        for m in (names * n)[:n]
    ]
    return sets


# ---- quality --------------------------------------------------------------------------------
def greedy(llm: LLM, prompt: ChunkedPrompt, fraction: float | None, max_tokens: int) -> list[int]:
    blend = None if fraction is None else BlendSpec(prompt.spans, fraction)
    rid = f"q{time.monotonic_ns()}"
    llm.engine.add_request(rid, prompt.token_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens), blend=blend)
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                return out.outputs[0].token_ids
    raise RuntimeError("no output")


@torch.inference_mode()
def answer_logprobs(llm: LLM, prompt: ChunkedPrompt, answer: list[int], fraction: float | None) -> torch.Tensor:
    """Next-token log-probabilities at each answer position, the answer teacher-forced after the prompt."""
    blender, n = llm.engine.blender, len(prompt.token_ids)
    tokens = prompt.token_ids + answer
    plan = None if fraction is None else blender.plan(tokens, BlendSpec(prompt.spans, fraction))
    ids = torch.tensor(tokens)
    hidden, rows = blend_forward(blender.model, ids, torch.arange(len(tokens)), plan, lambda *a: None)
    wanted = (rows >= n - 1) & (rows < n - 1 + len(answer))
    return torch.log_softmax(blender.model.compute_logits(hidden[wanted]), dim=-1)


def rouge_l(a: str, b: str) -> float:
    x, y = a.split(), b.split()
    if not x or not y:
        return float(x == y)
    prev = [0] * (len(y) + 1)
    for tx in x:
        cur = [0]
        for j, ty in enumerate(y):
            cur.append(prev[j] + 1 if tx == ty else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, r = lcs / len(y), lcs / len(x)
    return 2 * p * r / (p + r)


METRICS = ("first", "exact", "rouge", "kl")


def quality(llm: LLM, prompts: list[ChunkedPrompt], max_tokens: int, configs: dict[str, tuple], rows: dict, saved):
    """Appends each prompt's scores to rows[label][metric] (configs: label -> (fraction, Selection)) and calls
    saved() after each prompt; each prompt's full prefill is computed once."""
    tok, blender = llm.tokenizer, llm.engine.blender
    for prompt in prompts:
        ref = greedy(llm, prompt, None, max_tokens)
        ref_text = tok.decode(ref)
        ref_lp = answer_logprobs(llm, prompt, ref, None)
        for label, (f, selection) in configs.items():
            blender.selection = selection
            got = greedy(llm, prompt, f, max_tokens)
            text = tok.decode(got)
            lp = answer_logprobs(llm, prompt, ref, f)
            r = rows.setdefault(label, {m: [] for m in METRICS})
            r["first"].append(float(got[:1] == ref[:1]))
            r["exact"].append(float(text.strip() == ref_text.strip()))
            r["rouge"].append(rouge_l(ref_text, text))
            r["kl"].append(float((ref_lp.exp() * (ref_lp - lp)).sum(-1).mean()))
        saved()


def summarize(rows: dict) -> dict:
    return {c: {m: statistics.fmean(r[m]) for m in METRICS} | {"prompts": len(r["first"])} for c, r in rows.items()}


# ---- TTFT -----------------------------------------------------------------------------------
def ttft(llm: LLM, prompt: ChunkedPrompt, fraction: float | None) -> float:
    blend = None if fraction is None else BlendSpec(prompt.spans, fraction)
    rid = f"t{time.monotonic_ns()}"
    t0 = time.perf_counter()
    llm.engine.add_request(rid, prompt.token_ids, SamplingParams(temperature=0.0, max_tokens=1), blend=blend)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    return time.perf_counter() - t0


def speed(cached: LLM, uncached: LLM, pool: list[str], fractions: list[float], requests: int) -> dict:
    """Warm both modes with the pool in threes, then time new combinations and orders, interleaved;
    blend at each fraction ("blend" is the first)."""
    tok, rng = cached.tokenizer, random.Random(7)
    question = "Summarize what the documents say, in one sentence."
    for i in range(0, len(pool), 3):
        warm = rag_prompt(tok, pool[i : i + 3], question)
        ttft(cached, warm, fractions[0])
        ttft(cached, warm, None)
        ttft(uncached, warm, None)
    modes = {"blend": fractions[0]} | {f"blend@{f}": f for f in fractions[1:]}
    times = {"full_prefill": [], "prefix_caching": []} | {m: [] for m in modes}
    lengths = []
    for _ in range(requests):
        prompt = rag_prompt(tok, rng.sample(pool, rng.randint(3, 6)), question)
        lengths.append(len(prompt.token_ids))
        times["full_prefill"].append(ttft(uncached, prompt, None))
        times["prefix_caching"].append(ttft(cached, prompt, None))
        for mode, f in modes.items():
            times[mode].append(ttft(cached, prompt, f))
    out = {k: {"median_s": statistics.median(v), "mean_s": statistics.fmean(v)} for k, v in times.items()}
    return out | {"prompt_tokens_mean": statistics.fmean(lengths), "requests": requests, "fraction": fractions[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=12, help="quality prompts per set")
    parser.add_argument("--requests", type=int, default=10, help="timed requests per mode")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--fraction", default="0.15", help="the fractions timed (the first is the default's)")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--sets", default="corpus,stdlib", help="quality prompt sets to run")
    parser.add_argument("--merge", action="store_true", help="keep --out's TTFT and other sets; add these")
    parser.add_argument("--skip-ttft", action="store_true")
    parser.add_argument("--fractions", default=",".join(map(str, FRACTIONS)), help="recompute fractions measured")
    parser.add_argument("--canonical-prefix", default="", help="text chunks are computed after (ablation)")
    parser.add_argument("--selection", default="", help="sink,filter_layers,filter_start,value_weight[,check_layer]")
    parser.add_argument("--variants", default="", help="label=<selection>;... : compare selections (ablation)")
    parser.add_argument("--compare", default="", help="label=fraction:<selection>;... : further configurations")
    parser.add_argument("--prompt-range", default=":", help="a:b: only these prompts of each set (with --merge)")
    parser.add_argument("--out", default="bench/results/blend")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    common = dict(num_gpu_blocks=2048, max_num_batched_tokens=4096, enforce_eager=True)
    cached = LLM(args.model, **common)
    uncached = LLM(args.model, loaded_model=cached.engine.runner.model, enable_prefix_caching=False, **common)
    fractions = [float(f) for f in args.fractions.split(",")]
    configs = {str(f): (f, selection(args.selection)) for f in fractions}
    if args.variants:
        variants = [v.split("=") for v in args.variants.split(";")]
        configs = {f"{label}@{f}": (f, selection(sel)) for label, sel in variants for f in fractions}
    for label, spec in (c.split("=") for c in args.compare.split(";") if c):
        f, sel = spec.split(":")
        configs[label] = (float(f), selection(sel))
    prefix = cached.tokenizer.encode(args.canonical_prefix, add_special_tokens=False) if args.canonical_prefix else []
    cached.engine.blender.canonical_prefix = prefix
    result = {"model": args.model, "fractions": fractions, "max_tokens": args.max_tokens, "canonical_prefix": prefix}
    result |= {"selection": vars(selection(args.selection)), "variants": args.variants}
    cached.engine.blender.selection = selection(args.selection)
    if args.merge:
        result = json.loads(Path(args.out + ".json").read_text())
    elif not args.skip_ttft:
        pool = [t for texts in corpus_docs(cached.tokenizer).values() for t in texts[:1]][:9]
        result["ttft"] = speed(cached, uncached, pool, [float(f) for f in args.fraction.split(",")], args.requests)
        print(json.dumps(result["ttft"], indent=1), flush=True)
        save(result, args.out)
    if not args.skip_quality:
        sets = prompt_sets(cached.tokenizer, args.prompts, seed=0)
        first, last = (int(x) if x else None for x in args.prompt_range.split(":"))
        for name in args.sets.split(","):
            rows = result.setdefault("quality", {}).setdefault(name, {})
            quality(cached, sets[name][first:last], args.max_tokens, configs, rows, lambda: save(result, args.out))
            print(name, json.dumps(summarize(rows), indent=1), flush=True)


def selection(text: str) -> Selection:
    """ "sink_tokens,filter_layers,filter_start,value_weight[,check_layer]" (empty: the engine's default)."""
    if not text:
        return Selection()
    sink, layers, start, weight, *check = text.split(",")
    return Selection(int(sink), int(layers), float(start), float(weight), *map(int, check))


def save(result: dict, out: str) -> None:
    Path(out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    Path(out + ".md").write_text(render(result))


def render(result: dict) -> str:
    lines = [f"# CacheBlend on {result['model']} (bench/blend.py)", ""]
    if result.get("canonical_prefix"):
        lines += [f"Chunks computed after the canonical prefix token ids {result['canonical_prefix']}.", ""]
    t = result.get("ttft")
    lines += (
        []
        if t is None
        else [
            f"## TTFT ({t['requests']} requests of 3-6 documents, {t['prompt_tokens_mean']:.0f} prompt tokens on "
            f"average, recompute {t['fraction']:.0%})",
            "",
            "| mode | median TTFT (s) | mean TTFT (s) | speed-up vs prefix caching |",
            "|---|---|---|---|",
        ]
    )
    for mode in [k for k, v in t.items() if isinstance(v, dict)] if t else ():
        m, base = t[mode], t["prefix_caching"]["median_s"]
        lines.append(f"| {mode} | {m['median_s']:.3f} | {m['mean_s']:.3f} | {base / m['median_s']:.2f}x |")
    for name, per_prompt in result.get("quality", {}).items():
        rows = summarize(per_prompt)
        lines += ["", f"## Quality vs full prefill: {name} set ({next(iter(rows.values()))['prompts']} prompts)", ""]
        lines += ["| recompute | first-token agreement | exact match | ROUGE-L | mean KL |", "|---|---|---|---|---|"]
        for f, r in rows.items():
            label = f if "@" in f else f"{float(f):.0%}"
            lines.append(f"| {label} | {r['first']:.0%} | {r['exact']:.0%} | {r['rouge']:.3f} | {r['kl']:.4f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
