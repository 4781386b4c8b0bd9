"""Engine benchmark (issues 3, 15, 17): ragserve against Hugging Face transformers and llama.cpp on the same
weights, in one run, with this machine's measured limits.

    python bench/engine.py --part throughput   # batch 1/8/32 decode and overall, cold prefill 512/2,048
    python bench/engine.py --part mixed        # 64 requests of mixed lengths, fair (length-bucketed) HF
    python bench/engine.py --part precision    # bf16 / int8 weights: single-stream decode, token agreement
    python bench/engine.py --part features     # prefix-cache TTFT, KV waste, forked sequences
    python bench/engine.py --part profile      # torch.profiler top-10 of decode steps (--batch 32, --quantization)
    python bench/engine.py --part linear       # decode-sized matmuls: nn.Linear vs oneDNN prepacked
    python bench/engine.py --part lowp         # decode-sized matmuls: fp32 / bf16 packed vs int8 weights
    add --quick for a short run

Each configuration runs `--repeats` times (default 3), the three systems interleaved so they see the
same background load; the table gives the median and the min-max spread. Limits come from an fp32
square GEMM and a streaming read measured at the start of the same run (bench/engine_baselines.py).
Writes bench/results/engine-<part>[-quick].md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_baselines import (  # noqa: E402
    FirstTokenClock,
    LlamaCpp,
    Machine,
    Roofline,
    hf_bucketed,
    hf_generate,
    hf_prefill,
    load_hf,
    measure_machine,
)

from ragserve.model_source import resolve_model  # noqa: E402
from ragserve_engine.llm import LLM  # noqa: E402
from ragserve_engine.sampling_params import SamplingParams  # noqa: E402

RESULTS = Path(__file__).parent / "results"
PROMPT_LEN, NEW_TOKENS = 128, 64


def rand_prompts(rng: random.Random, n: int, length: int | tuple[int, int]) -> list[list[int]]:
    lengths = [length if isinstance(length, int) else rng.randint(*length) for _ in range(n)]
    return [[rng.randrange(100, 49000) for _ in range(k)] for k in lengths]


def ours_run(llm: LLM, prompts: list[list[int]], outputs: list[int]) -> float:
    """All requests at once (continuous batching), greedy, ignore_eos: wall seconds."""
    engine = llm.engine
    for i, (p, n) in enumerate(zip(prompts, outputs, strict=True)):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", p, SamplingParams(temperature=0.0, max_tokens=n,
                                                                           ignore_eos=True))  # fmt: skip
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0


def ours_decode_run(llm: LLM, prompts: list[list[int]], new_tokens: int) -> tuple[float, float, int]:
    """All requests at once, each to new_tokens: (wall seconds, seconds until every request had its first token,
    tokens generated after that moment). Decode-only speed is the last over (wall - first), measured in one run."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    reqs = [engine.add_request(f"d{time.monotonic_ns()}-{i}", p, params) for i, p in enumerate(prompts)]
    t0, first, at_first = time.perf_counter(), 0.0, 0
    while engine.has_unfinished_requests():
        engine.step()
        if not first and all(r.seqs[0].output_token_ids for r in reqs):
            first = time.perf_counter() - t0
            at_first = sum(len(r.seqs[0].output_token_ids) for r in reqs)
    return time.perf_counter() - t0, first, len(prompts) * new_tokens - at_first


def fresh_llm(args, model, **kw) -> LLM:
    return LLM(args.model, loaded_model=model, enable_prefix_caching=False, max_num_seqs=64, **kw)


class Table:
    """Samples per (row, column); rendered as median (min-max) and kept raw in the JSON."""

    def __init__(self) -> None:
        self.samples: dict[str, dict[str, list[float]]] = {}
        self.notes: dict[str, str] = {}

    def add(self, row: str, col: str, value: float) -> None:
        self.samples.setdefault(row, {}).setdefault(col, []).append(value)

    def med(self, row: str, col: str) -> float:
        return statistics.median(self.samples[row][col])

    def cell(self, row: str, col: str, fmt: str = "{:.1f}") -> str:
        vals = self.samples.get(row, {}).get(col)
        if not vals:
            return "–"
        m = statistics.median(vals)
        return fmt.format(m) + (f" ({fmt.format(min(vals))}–{fmt.format(max(vals))})" if len(vals) > 1 else "")


def decode_rates(t: Table, row: str, sys_name: str, batch: int, full: float, first: float, after: int) -> None:
    """Overall output tokens/s, and decode-only tokens/s: the `after` tokens generated once every sequence had
    its first token, over the time from then to the end (one run: no prefill-only run to subtract)."""
    t.add(row, f"{sys_name} overall", batch * NEW_TOKENS / full)
    t.add(row, f"{sys_name} decode", after / max(full - first, 1e-9))


def part_throughput(args, model, hf, cpp, m: Machine, roof: Roofline, t: Table, save) -> None:
    rng = random.Random(17)
    warm = rand_prompts(rng, 2, 160)  # a step of >= 128 tokens: the fused ops get compiled (or loaded) here
    ours_run(fresh_llm(args, model), warm, [4, 4]), hf_generate(hf, warm, 4), cpp and cpp.generate(warm[0], 4)
    batches = [1, 8] if args.quick else [1, 8, 32]
    warm_rng = random.Random(1)
    # the very workload of each batch size once: every decode graph size its steps reach (the batch and the
    # sizes it shrinks through as sequences finish) is compiled, or loaded from inductor's cache (~4-8 s a
    # size), before anything is timed
    for b in batches:
        ours_decode_run(fresh_llm(args, model), rand_prompts(warm_rng, b, PROMPT_LEN), NEW_TOKENS)
    prefills = [512] if args.quick else [512, 2048]
    for rep in range(args.repeats):
        for b in batches:
            row = f"batch {b} × {PROMPT_LEN}-token prompts, {NEW_TOKENS} new tokens"
            prompts = rand_prompts(rng, b, PROMPT_LEN)
            llm = fresh_llm(args, model)
            decode_rates(t, row, "ragserve", b, *ours_decode_run(llm, prompts, NEW_TOKENS))
            graphs = llm.engine.runner.decode_graphs
            if slow := {k: round(v, 1) for k, v in (graphs.stats.compile_seconds if graphs else {}).items() if v > 1}:
                t.notes[row] = f"decode graphs compiled or loaded inside a timed run (batch: seconds): {slow}"
            clock = FirstTokenClock()
            hfull, _ = hf_generate(hf, prompts, NEW_TOKENS, clock)
            decode_rates(t, row, "HF", b, hfull, clock.first, b * (NEW_TOKENS - 1))
            if cpp and b == 1:
                decode_rates(t, row, "llama.cpp", 1, *cpp.generate(prompts[0], NEW_TOKENS), NEW_TOKENS - 1)
            step_s = b / roof.decode_tok_s(m, b, PROMPT_LEN + NEW_TOKENS // 2)
            t.add(row, "limit decode", b / step_s)
            t.add(
                row, "limit overall", b * NEW_TOKENS / (b * roof.prefill_s(m, PROMPT_LEN) + (NEW_TOKENS - 1) * step_s)
            )
        for n in prefills:
            row = f"cold prefill, {n} tokens, 1 request (seconds)"
            prompt = rand_prompts(rng, 1, n)[0]
            t.add(row, "ragserve", ours_run(fresh_llm(args, model), [prompt], [1]))
            t.add(row, "HF", hf_prefill(hf, prompt))
            if cpp:
                t.add(row, "llama.cpp", cpp.prefill(prompt))
            t.add(row, "limit", roof.prefill_s(m, n))
        save(f"{rep + 1} of {args.repeats} repeats")


def part_mixed(args, model, hf, m: Machine, roof: Roofline, t: Table, save) -> None:
    n, prompt_range, out_range = (16, (64, 256), (8, 32)) if args.quick else (64, (64, 256), (16, 48))
    row = f"mixed: {n} requests, prompts {prompt_range[0]}–{prompt_range[1]}, outputs {out_range[0]}–{out_range[1]}"
    t.notes[row] = "tokens/s = (prompt + output tokens) / wall; HF is credited with every token it computed"

    def workload(rep: int) -> tuple[list[list[int]], list[int]]:
        rng = random.Random(100 + rep)
        prompts = rand_prompts(rng, n, prompt_range)
        return prompts, [rng.randint(*out_range) for _ in range(n)]

    warm = rand_prompts(random.Random(1), 2, 160)
    ours_run(fresh_llm(args, model), *workload(0)), hf_generate(hf, warm, 4)  # every decode-graph size it reaches
    for rep in range(args.repeats):
        prompts, outputs = workload(rep)
        requested = sum(map(len, prompts)) + sum(outputs)
        t.add(row, "ragserve", requested / ours_run(fresh_llm(args, model), prompts, outputs))
        for b in (8, 16):
            wall, computed = hf_bucketed(hf, prompts, outputs, b)
            t.add(row, f"HF batch {b}", computed / wall)
        limit_s = sum(roof.prefill_s(m, len(p)) for p in prompts) + max(outputs) * len(prompts) / roof.decode_tok_s(
            m, len(prompts), 256)  # fmt: skip
        t.add(row, "limit", requested / limit_s)
        save(f"{rep + 1} of {args.repeats} repeats")


def part_precision(args, model_fp32, cpp, m: Machine, t: Table, save) -> None:
    """Single-stream decode with bf16, int8 and int4 weights vs llama.cpp; greedy agreement with fp32."""
    rng = random.Random(5)
    llms = {"float32": fresh_llm(args, model_fp32)}
    lowp = {"bfloat16": {"dtype": "bfloat16"}, "int8": {"quantization": "int8"}, "int4": {"quantization": "int4"}}
    for name, kw in lowp.items():
        llms[name] = LLM(args.model, enable_prefix_caching=False, **kw)
    # Q4_1 and int4: 20 bytes / 32 weights (both keep the LM head in 8 bits, not counted here)
    bytes_per_param = {"float32": 4.0, "bfloat16": 2.0, "int8": 1.0, "int4": 0.625, "Q4_1": 0.625}
    tok = llms["float32"].tokenizer
    words = ["refrigerator", "compiler", "bicycle", "vaccine", "search engine", "battery", "bridge", "database"]
    prompts = [tok.encode(f"Question {i}: explain briefly how a {w} works, step by step.") for i, w in enumerate(words)]
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llms["float32"].generate(prompts, greedy)]
    agree = f"greedy agreement with float32 ({len(prompts)} English prompts × {NEW_TOKENS} tokens)"
    t.notes[agree] = "mean tokens identical before the first divergence (free-running)"
    for name, llm in llms.items():
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        same = [next((i for i, (a, b) in enumerate(zip(r, o, strict=True)) if a != b), len(r))
                for r, o in zip(ref, outs, strict=True)]  # fmt: skip
        t.add(agree, name, statistics.mean(same))
    row = f"single stream, {PROMPT_LEN}-token prompt, {NEW_TOKENS} new tokens: decode tokens/s"
    for llm in llms.values():  # warm-up: a >= 128-token step compiles (or loads) the fused ops
        ours_run(llm, rand_prompts(rng, 1, 160), [4])
    for name, b in bytes_per_param.items():  # before the repeats: each save() writes them
        t.add(row, f"limit {name}", Roofline.of(model_fp32, b).decode_tok_s(m, 1, PROMPT_LEN + NEW_TOKENS // 2))
    for rep in range(args.repeats):
        prompt = rand_prompts(rng, 1, PROMPT_LEN)[0]
        for name, llm in llms.items():
            full, first, after = ours_decode_run(llm, [prompt], NEW_TOKENS)
            t.add(row, name, after / (full - first))
        if cpp:
            full, first = cpp.generate(prompt, NEW_TOKENS)
            t.add(row, "llama.cpp Q4_1", (NEW_TOKENS - 1) / (full - first))
        save(f"{rep + 1} of {args.repeats} repeats")


def render(args, t: Table, m: Machine, load: tuple[float, float], started: float) -> str:
    cmd = f"python bench/engine.py --part {args.part}{' --quick' if args.quick else ''}"
    lines = [
        f"`{cmd}` ({args.model}, float32 unless noted, CPU, {torch.get_num_threads()} torch threads, llama.cpp "
        f"2 threads, {args.repeats} interleaved repeats: median (min–max)).",
        "",
        f"Measured in this run: fp32 GEMM peak {m.gemm_flops / 1e9:.0f} GFLOP/s (2,048² matmul), read bandwidth "
        f"{m.read_bytes / 1e9:.1f} GB/s (sum over 512 MiB). Load average before / after: {load[0]:.1f} / "
        f"{load[1]:.1f} (2 cores, shared machine). Wall {time.time() - started:.0f} s.",
        "",
    ]
    for row, cols in t.samples.items():
        seconds = "(seconds)" in row
        limits = [c for c in cols if c.startswith("limit")]
        lines += [f"**{row}**" + (f": {t.notes[row]}" if row in t.notes else ""), ""]
        lines += ["| | median (min–max) | fraction of limit |", "|---|---:|---:|"]
        for c in cols:
            frac = ""
            if limits and not c.startswith("limit"):
                match = [lim for lim in limits if lim.split()[-1] in c.split()]
                limit = t.med(row, (match or limits)[0])
                frac = f"{(limit / t.med(row, c) if seconds else t.med(row, c) / limit):.0%}"
            lines.append(f"| {c} | {t.cell(row, c, '{:.2f}' if seconds else '{:.1f}')} | {frac} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parts = ["throughput", "mixed", "precision", "features", "profile", "linear", "lowp"]
    parser.add_argument("--part", choices=parts, default="throughput")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true", help="--part profile: without decode graphs")
    parser.add_argument("--batch", type=int, default=32, help="--part profile: sequences decoding")
    parser.add_argument("--quantization", default="none", help="--part profile: none, int8 or int4")
    parser.add_argument("--tag", default="", help="--part profile: suffix of the result file's name")
    args = parser.parse_args()
    torch.manual_seed(0)
    started, load0 = time.time(), os.getloadavg()[0]
    if args.part in ("features", "profile", "linear", "lowp"):
        from engine_features import run_features, run_linear, run_linear_lowp, run_profile

        parts = {"features": run_features, "profile": run_profile, "linear": run_linear, "lowp": run_linear_lowp}
        parts[args.part](args)
        return
    source = resolve_model(args.model)
    llm = LLM(args.model)
    model = llm.engine.runner.model
    m, roof = measure_machine(), Roofline.of(model)
    cpp = None if args.no_llama_cpp or source.kind != "gguf" else LlamaCpp(str(source.path), threads=2)
    t = Table()
    name = f"engine-{args.part}{'-quick' if args.quick else ''}"

    def save(progress: str) -> None:
        """Written after every repeat, so a run cut short by its time limit still leaves its samples."""
        text = render(args, t, m, (load0, os.getloadavg()[0]), started) + f"\nCompleted: {progress}.\n"
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{name}.md").write_text(text)
        raw = {"machine": vars(m), "samples": t.samples, "args": vars(args), "completed": progress}
        (RESULTS / f"{name}.json").write_text(json.dumps(raw, indent=1) + "\n")
        print(text, flush=True)

    if args.part == "precision":
        part_precision(args, model, cpp, m, t, save)
    else:
        hf = load_hf(source)
        if args.part == "throughput":
            part_throughput(args, model, hf, cpp, m, roof, t, save)
        else:
            part_mixed(args, model, hf, m, roof, t, save)


if __name__ == "__main__":
    main()
