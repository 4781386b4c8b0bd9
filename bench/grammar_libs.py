"""xgrammar vs llguidance on SmolLM2's tokenizer: schema compile time and per-step mask time at batch 32.

Each step: fill 32 token bitmasks (the library's batched/parallel fill), apply them to [32, vocab] logits
(one masked fill), advance each matcher by one token of a valid JSON document. Interleaved repeats, median.
Run: flock /tmp/cpu.lock .venv/bin/python bench/grammar_libs.py
"""

from __future__ import annotations

import json
import statistics
import time

import torch
from transformers import PreTrainedTokenizerFast

from ragserve.model_source import load_tokenizer, resolve_model

BATCH, REPEATS = 32, 5
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 200},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "sources": {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 8},
        "kind": {"enum": ["fact", "opinion", "unknown"]},
        "meta": {"type": "object", "properties": {"lang": {"type": "string"}}, "required": ["lang"]},
    },
    "required": ["answer", "confidence", "sources", "kind", "meta"],
    "additionalProperties": False,
}
DOC = {"answer": "Paris is the capital of France.", "confidence": 0.9, "sources": [1, 4], "kind": "fact",
       "meta": {"lang": "en"}}  # fmt: skip


def xgrammar_run(hf, tokens, vocab, schema):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    t0 = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(json.dumps(schema))
    compile_s = time.perf_counter() - t0
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(BATCH)]
    bitmask, batch = xgr.allocate_token_bitmask(BATCH, vocab), xgr.BatchGrammarMatcher()
    logits = torch.randn(BATCH, vocab)
    t0 = time.perf_counter()
    for tok in tokens:
        batch.batch_fill_next_token_bitmask(matchers, bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        for m in matchers:
            assert m.accept_token(tok)
    return compile_s, (time.perf_counter() - t0) / len(tokens)


def llguidance_run(hf, tokens, vocab, schema):
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    lltok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    matchers = [llguidance.LLMatcher(lltok, grammar)]  # a matcher compiles its grammar (each one does)
    compile_s = time.perf_counter() - t0
    matchers += [llguidance.LLMatcher(lltok, grammar) for _ in range(BATCH - 1)]
    bitmask, executor = lt.allocate_token_bitmask(BATCH, vocab), llguidance.LLExecutor()
    logits = torch.randn(BATCH, vocab)
    t0 = time.perf_counter()
    for tok in tokens:
        lt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        lt.apply_token_bitmask_inplace(logits, bitmask)
        for m in matchers:
            assert m.consume_token(tok), m.get_error()
    return compile_s, (time.perf_counter() - t0) / len(tokens)


def main() -> None:
    tok = load_tokenizer(resolve_model("smollm2-135m"))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok.tokenizer, eos_token=tok.special_tokens.get("eos_token"))
    tokens, vocab = tok.encode(json.dumps(DOC), add_special_tokens=False), tok.vocab_size
    runs = {"xgrammar": xgrammar_run, "llguidance": llguidance_run}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for i in range(REPEATS):
        schema = {**SCHEMA, "title": f"run{i}"}  # a new schema each time: no library cache hit
        for name, fn in runs.items():
            results[name].append(fn(hf, tokens, vocab, schema))
    print(f"batch {BATCH}, {len(tokens)} tokens, vocab {vocab}, median of {REPEATS}")
    for name, rows in results.items():
        c = statistics.median(r[0] for r in rows) * 1e3
        m = statistics.median(r[1] for r in rows) * 1e3
        print(f"{name:11s} compile {c:8.2f} ms   mask+apply+advance per step (32 rows) {m:7.3f} ms")


if __name__ == "__main__":
    main()
