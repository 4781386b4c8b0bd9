"""Engine benchmark (issue 3): ragserve vs Hugging Face transformers on the same weights, same run.

    python bench/engine.py            # full run (~10+ minutes on 2 CPU cores)
    python bench/engine.py --quick    # reduced, a couple of minutes

Prints a markdown table of ratios and writes it to bench/results/engine.md.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ragserve.model_source import resolve_model
from ragserve_engine.llm import LLM
from ragserve_engine.sampling_params import SamplingParams

RESULTS = Path(__file__).parent / "results"


@dataclass
class Workload:
    prompts: list[list[int]]
    outputs: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.outputs)


def make_workload(n: int, prompt_range: tuple[int, int], out_range: tuple[int, int], seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 49000) for _ in range(rng.randint(*prompt_range))] for _ in range(n)]
    return Workload(prompts, [rng.randint(*out_range) for _ in range(n)])


def run_ragserve(llm: LLM, w: Workload) -> tuple[float, float]:
    """(wall seconds, mean KV waste fraction at steady state)."""
    engine = llm.engine
    for i, (p, n) in enumerate(zip(w.prompts, w.outputs, strict=True)):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", p, SamplingParams(temperature=0.0, max_tokens=n,
                                                                                ignore_eos=True))  # fmt: skip
    waste = []
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        running = [s for r in engine.scheduler.running for s in r.live_seqs]
        if running and not engine.scheduler.waiting:
            allocated = engine.stats().used_blocks * engine.config.block_size
            waste.append(1 - sum(s.num_tokens for s in running) / allocated)
    return time.perf_counter() - t0, sum(waste) / max(1, len(waste))


def run_hf(hf, w: Workload, batch_size: int) -> float:
    """Left-padded batches with attention masks; each batch runs to its longest requested output."""
    t0 = time.perf_counter()
    for i in range(0, len(w.prompts), batch_size):
        batch, outs = w.prompts[i : i + batch_size], w.outputs[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, max_new_tokens=max(outs), min_new_tokens=max(outs),
                        do_sample=False, pad_token_id=0)  # fmt: skip
    return time.perf_counter() - t0


def matmul_peak(cfg, tokens: int = 2048, repeats: int = 5) -> float:
    """This machine's fp32 matmul FLOP/s on the model's own projection shapes."""
    h, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    shapes = [(h, h + 2 * kv), (h, h), (h, 2 * cfg.intermediate_size), (cfg.intermediate_size, h)]
    mats = [(torch.randn(tokens, k), torch.randn(k, n)) for k, n in shapes]
    for a, b in mats:
        a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for a, b in mats:
            a @ b
        best = min(best, time.perf_counter() - t0)
    return sum(2 * tokens * k * n for k, n in shapes) / best


def prefill_flops(cfg, prompts: list[list[int]]) -> float:
    h, kv, inter = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    per_token = 2 * cfg.num_layers * (h * (h + 2 * kv) + h * h + 3 * h * inter)
    attn = sum(4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * len(p) * (len(p) + 1) / 2 for p in prompts)
    return per_token * sum(len(p) for p in prompts) + attn + 2 * h * cfg.vocab_size * len(prompts)


def bench_prefill_efficiency(llm: LLM, w: Workload) -> tuple[float, float]:
    cfg = llm.engine.runner.model_config
    peak = matmul_peak(cfg)
    fresh = LLM(llm.engine.config.model, loaded_model=llm.engine.runner.model, enable_prefix_caching=False)
    wall, _ = run_ragserve(fresh, Workload(w.prompts, [1] * len(w.prompts)))
    return prefill_flops(cfg, w.prompts) / wall / peak, peak


def bench_prefix_ttft(llm: LLM, context_tokens: int, questions: int) -> float:
    rng = random.Random(1)
    context = [rng.randrange(100, 49000) for _ in range(context_tokens)]
    fresh = LLM(llm.engine.config.model, loaded_model=llm.engine.runner.model)
    ttfts = []
    for q in range(questions):
        prompt = context + [rng.randrange(100, 49000) for _ in range(24 + q)]
        t0 = time.perf_counter()
        fresh.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
        ttfts.append(time.perf_counter() - t0)
    return (sum(ttfts[1:]) / len(ttfts[1:])) / ttfts[0]


def bench_fork_blocks(llm: LLM) -> tuple[float, float]:
    prompt = list(range(1000, 1500))

    def peak(params_list: list[SamplingParams]) -> int:
        fresh = LLM(llm.engine.config.model, loaded_model=llm.engine.runner.model, enable_prefix_caching=False)
        for i, p in enumerate(params_list):
            fresh.engine.add_request(f"f{i}", prompt, p)
        top = 0
        while fresh.engine.has_unfinished_requests():
            fresh.engine.step()
            top = max(top, fresh.engine.stats().used_blocks)
        return top

    indep = peak([SamplingParams(max_tokens=32, ignore_eos=True, seed=i) for i in range(4)])
    n4 = peak([SamplingParams(n=4, max_tokens=32, ignore_eos=True, seed=0)])
    beam = peak([SamplingParams(use_beam_search=True, beam_width=4, temperature=0.0, max_tokens=32, ignore_eos=True)])
    return n4 / indep, beam / indep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.quick:
        w, batches, ctx = make_workload(16, (128, 384), (16, 32)), [8], 1024
    else:
        w, batches, ctx = make_workload(64, (256, 1024), (64, 128)), [8, 16], 2048
    llm = LLM(args.model)
    rows = []
    ours, waste = run_ragserve(llm, w)
    from transformers import AutoModelForCausalLM

    source = resolve_model(args.model)
    load = dict(gguf_file=source.path.name) if source.kind == "gguf" else {}
    path = str(source.path.parent if source.kind == "gguf" else source.path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **load).eval()
    hf_times = {b: run_hf(hf, w, b) for b in batches}
    best_b = min(hf_times, key=hf_times.get)
    tokens = w.prompt_tokens + w.output_tokens
    rows.append(("Throughput (tokens/s), ragserve vs HF generate (best batch "
                 f"{best_b})", f"{tokens / ours:.0f} vs {tokens / hf_times[best_b]:.0f}",
                 f"{hf_times[best_b] / ours:.2f}x", "≥ 3x"))  # fmt: skip
    eff, peak = bench_prefill_efficiency(llm, w)
    rows.append(("Prefill FLOP/s as a fraction of fp32 matmul peak", f"peak {peak / 1e9:.0f} GFLOP/s", f"{eff:.0%}",
                 "≥ 60%"))  # fmt: skip
    ratio = bench_prefix_ttft(llm, ctx, 8)
    rows.append((f"Prefix cache: warm / cold TTFT, {ctx}-token shared context", "8 requests", f"{ratio:.3f}", "≤ 0.1"))
    rows.append(("KV memory waste at steady state", "(allocated − used) / allocated", f"{waste:.1%}", "< 4%"))
    n4, beam = bench_fork_blocks(llm)
    rows.append(("KV blocks, n=4 vs 4 independent requests", "peak blocks", f"{n4:.2f}x", "< 1"))
    rows.append(("KV blocks, beam width 4 vs 4 independent requests", "peak blocks", f"{beam:.2f}x", "< 1"))
    table = "| metric | detail | ragserve / baseline | target |\n|---|---|---|---|\n"
    table += "\n".join(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows)
    header = f"`python bench/engine.py{' --quick' if args.quick else ''}` ({args.model}, float32, CPU, " \
             f"{torch.get_num_threads()} threads, {len(w.prompts)} requests)\n\n"  # fmt: skip
    print(header + table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"engine{'-quick' if args.quick else ''}.md").write_text(header + table + "\n")


if __name__ == "__main__":
    main()
