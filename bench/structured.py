"""Decode throughput with a JSON schema vs unconstrained, batch 32, SmolLM2-135M, in-process engine; and
jump-forward on vs off on a schema of long fixed keys (whole requests, prefill included: same tokens).

Both runs in the same process, interleaved repeats, median. Each run: BATCH chat requests prefilled
together, then decoded to MAX_TOKENS (ignore_eos; a finished grammar ends its sequence early, so tok/s
counts the tokens each run produced; the schema's long minimum answer keeps every sequence running).
tok/s = output tokens / decode seconds (steps after the first).
Run: flock /tmp/cpu.lock .venv/bin/python bench/structured.py [--out bench/results/structured.md] (and .json)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from ragserve_engine.llm import LLM
from ragserve_engine.sampling_params import SamplingParams
from ragserve_engine.structured.spec import GuidedDecoding

BATCH, MAX_TOKENS, REPEATS = 32, 48, 3
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "minLength": 400},  # every sequence decodes all MAX_TOKENS
        "passages": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["answer", "passages", "confidence"],
}

LONG_KEYS = {  # most of the document is forced: keys, separators, and the enums' shared prefixes
    "type": "object",
    "properties": {
        "customer_account_identifier": {"type": "integer", "minimum": 0, "maximum": 999},
        "shipping_destination_country_code": {"enum": ["United States", "France", "Germany"]},
        "requires_signature_on_delivery": {"type": "boolean"},
        "preferred_delivery_time_window_description": {"enum": ["morning", "afternoon"]},
        "gift_wrapping_and_personal_message_requested": {"type": "boolean"},
    },
    "required": [
        "customer_account_identifier", "shipping_destination_country_code", "requires_signature_on_delivery",
        "preferred_delivery_time_window_description", "gift_wrapping_and_personal_message_requested",
    ],
    "additionalProperties": False,
}  # fmt: skip


def complete(llm: LLM, prompts: list[list[int]], guided: GuidedDecoding) -> tuple[float, int]:
    """(output tok/s over the whole batch, prefill included, output tokens): every request ends with its JSON."""
    engine, t0, tokens = llm.engine, time.perf_counter(), 0
    for i, p in enumerate(prompts):
        engine.add_request(
            f"c{time.monotonic_ns()}-{i}", p, SamplingParams(temperature=0, max_tokens=256, guided=guided)
        )
    while engine.has_unfinished_requests():
        tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    return tokens / (time.perf_counter() - t0), tokens


def run(llm: LLM, prompts: list[list[int]], guided: GuidedDecoding | None) -> tuple[float, int]:
    """(decode tok/s, output tokens)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, guided=guided)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, SamplingParams(**{**params.__dict__}))
    engine.step()  # the prefill (and first token) of the whole batch
    t0, tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    tokens -= BATCH  # the first tokens came from the prefill step
    return tokens / (time.perf_counter() - t0), tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    llm = LLM("smollm2-135m", num_gpu_blocks=BATCH * 8, max_num_seqs=BATCH, enforce_eager=True)
    questions = [f"Question {i}: which passages say when the library opens? Answer in JSON." for i in range(BATCH)]
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]
    guided = GuidedDecoding.json_schema(SCHEMA, "response_format")
    no_jump = LLM("smollm2-135m", loaded_model=llm.engine.runner.model, num_gpu_blocks=BATCH * 8, max_num_seqs=BATCH,
                  enforce_eager=True, enable_jump_forward=False)  # fmt: skip
    long_keys = GuidedDecoding.json_schema(LONG_KEYS, "response_format")
    run(llm, prompts[:2], guided)  # warm-up: the grammar tokenizer, compile cache, allocator
    run(no_jump, prompts[:2], guided)
    rates: dict[str, list[float]] = {k: [] for k in ("unconstrained", "json_schema", "long keys, jump-forward off",
                                                     "long keys, jump-forward on")}  # fmt: skip
    tokens: dict[str, int] = {}
    for _ in range(REPEATS):
        rates["unconstrained"].append(run(llm, prompts, None)[0])
        rates["json_schema"].append(run(llm, prompts, guided)[0])
        for name, engine in (("long keys, jump-forward off", no_jump), ("long keys, jump-forward on", llm)):
            rate, tokens[name] = complete(engine, prompts, long_keys)
            rates[name].append(rate)
    base, constrained = (statistics.median(rates[k]) for k in ("unconstrained", "json_schema"))
    off, on = (statistics.median(rates[f"long keys, jump-forward {k}"]) for k in ("off", "on"))
    speedup = on / off
    lines = [
        "# Structured outputs: decode tok/s with a JSON schema vs unconstrained",
        "",
        f"`bench/structured.py`: SmolLM2-135M, batch {BATCH}, greedy, {MAX_TOKENS} tokens, enforce_eager, "
        f"CPU ({platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads), "
        f"median of {REPEATS} interleaved repeats, llguidance masks.",
        "",
        "| run | decode tok/s (median) | repeats |",
        "|---|---|---|",
        *(f"| {k} | {statistics.median(v):.1f} | {', '.join(f'{x:.1f}' for x in v)} |" for k, v in rates.items()),
        "",
        f"JSON schema vs unconstrained: {100 * (1 - constrained / base):+.1f} % slower (goal: < 10 %).",
        "",
        f"Long keys (`LONG_KEYS`, whole requests, prefill included, max_tokens 256): output tokens "
        f"{tokens['long keys, jump-forward off']} (off) vs {tokens['long keys, jump-forward on']} (on); jump-forward "
        f"{speedup:.2f}x.",
    ]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
        result = {"batch": BATCH, "max_tokens": MAX_TOKENS, "repeats": REPEATS, "tok_s": rates, "tokens": tokens,
                  "json_schema_slowdown": 1 - constrained / base, "jump_forward_speedup": speedup}  # fmt: skip
        with open(args.out.removesuffix(".md") + ".json", "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
