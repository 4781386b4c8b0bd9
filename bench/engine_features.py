"""bench/engine.py --part features / profile: the engine's cache and scheduling features, and a
torch.profiler top-10 of decode steps."""

from __future__ import annotations

import random
import time
from functools import partial

from ragserve_engine.llm import LLM
from ragserve_engine.sampling_params import SamplingParams

RESULTS_NOTE = "(smollm2-135m, float32, CPU)"


def kv_waste(llm: LLM, prompts: list[list[int]], outputs: list[int]) -> float:
    """Mean (allocated - used) / allocated KV slots while everything runs and nothing waits."""
    engine, waste = llm.engine, []
    for i, (p, n) in enumerate(zip(prompts, outputs, strict=True)):
        engine.add_request(f"w{i}", p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        running = [s for r in engine.scheduler.running for s in r.live_seqs]
        if running and not engine.scheduler.waiting:
            allocated = engine.stats().used_blocks * engine.config.block_size
            waste.append(1 - sum(s.num_tokens for s in running) / allocated)
    return sum(waste) / max(1, len(waste))


def prefix_ttft(llm: LLM, context_tokens: int, questions: int) -> float:
    """Mean TTFT of requests sharing a cached context over the first (cold) one's."""
    rng = random.Random(1)
    context = [rng.randrange(100, 49000) for _ in range(context_tokens)]
    ttfts = []
    for q in range(questions):
        prompt = context + [rng.randrange(100, 49000) for _ in range(24 + q)]
        t0 = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
        ttfts.append(time.perf_counter() - t0)
    return (sum(ttfts[1:]) / len(ttfts[1:])) / ttfts[0]


def fork_blocks(args, model) -> tuple[float, float]:
    prompt = list(range(1000, 1500))

    def peak(params_list: list[SamplingParams]) -> int:
        fresh = LLM(args.model, loaded_model=model, enable_prefix_caching=False)
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


def run_features(args) -> None:
    from engine import RESULTS, rand_prompts

    llm = LLM(args.model)
    model = llm.engine.runner.model
    rng = random.Random(0)
    n = 16 if args.quick else 64
    prompts = rand_prompts(rng, n, (128, 384) if args.quick else (256, 1024))
    waste = kv_waste(LLM(args.model, loaded_model=model), prompts, [rng.randint(16, 64) for _ in prompts])
    ctx = 1024 if args.quick else 2048
    ratio = prefix_ttft(LLM(args.model, loaded_model=model), ctx, 8)
    n4, beam = fork_blocks(args, model)
    rows = [
        (f"Prefix cache: warm / cold TTFT, {ctx}-token shared context", "8 requests", f"{ratio:.3f}", "≤ 0.1"),
        ("KV memory waste at steady state", f"(allocated − used) / allocated, {n} requests", f"{waste:.1%}", "< 4%"),
        ("KV blocks, n=4 vs 4 independent requests", "peak blocks", f"{n4:.2f}x", "< 1"),
        ("KV blocks, beam width 4 vs 4 independent requests", "peak blocks", f"{beam:.2f}x", "< 1"),
    ]
    text = f"`python bench/engine.py --part features{' --quick' if args.quick else ''}` {RESULTS_NOTE}\n\n"
    text += "| metric | detail | value | target |\n|---|---|---|---|\n"
    text += "\n".join(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows)
    print(text)
    (RESULTS / f"engine-features{'-quick' if args.quick else ''}.md").write_text(text + "\n")


def run_profile(args) -> None:
    """Top-10 ops (self CPU time) over `steps` decode steps at --batch sequences of 128-token prompts,
    with compiled decode graphs or --enforce-eager, float32 or --quantization; the wall time not in any op
    is Python."""
    from torch.profiler import ProfilerActivity, profile

    from engine import RESULTS, rand_prompts

    batch, quant = args.batch, args.quantization
    steps = max(10, 64 // batch)
    mode = ("eager" if args.enforce_eager else "graphs") + ("" if quant == "none" else f"-{quant}") + args.tag
    llm = LLM(args.model, enable_prefix_caching=False, enforce_eager=args.enforce_eager, quantization=quant)
    engine = llm.engine
    for i, p in enumerate(rand_prompts(random.Random(0), batch, 128)):
        engine.add_request(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True))
    while engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    dt = (time.perf_counter() - t0) / steps
    events = prof.key_averages()
    in_ops = sum(e.self_cpu_time_total for e in events) / 1e3 / steps
    table = events.table(sort_by="self_cpu_time_total", row_limit=10)
    flag = (" --enforce-eager" if args.enforce_eager else "") + f" --batch {batch}" + (
        f" --quantization {quant}" if quant != "none" else "")  # fmt: skip
    text = (
        f"`python bench/engine.py --part profile{flag}` {RESULTS_NOTE}, {mode}: {steps} decode steps at batch "
        f"{batch} (128-token prompts), {dt * 1000:.0f} ms/step under the profiler ({batch / dt:.0f} tok/s), of "
        f"which {in_ops:.0f} ms in torch ops and {dt * 1000 - in_ops:.0f} ms outside them (Python)\n\n{table}"
    )
    print(text)
    (RESULTS / f"profile-decode{batch}-{mode}.txt").write_text(text + "\n")


def run_linear(args, layers: int = 30, repeats: int = 5) -> None:
    """Decode-sized matmuls: nn.Linear (MKL sgemm) vs oneDNN on a prepacked weight (PackedLinear), float32,
    SmolLM2-135M's shapes, 30 distinct weights per shape (read from memory as in a real step)."""
    import torch

    from engine import RESULTS
    from ragserve_engine.layers.packed_linear import BATCH_HINT

    shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
    lines = [f"`python bench/engine.py --part linear` (float32, CPU, {torch.get_num_threads()} threads): "
             f"ms per decode step for each projection summed over {layers} layers (lm_head once), "
             f"best of {repeats}; oneDNN weights packed for {BATCH_HINT} rows", "",
             "| rows | projection | nn.Linear ms | packed ms | speed-up |", "|---:|---|---:|---:|---:|"]  # fmt: skip
    with torch.inference_mode():
        for rows in (1, 8, 32, 512):
            total = [0.0, 0.0]
            for name, (n, k) in shapes.items():
                ws = [torch.randn(n, k) * 0.02 for _ in range(1 if name == "lm_head" else layers)]
                x = torch.randn(rows, k)
                ms = [_best_ms(repeats, x, ws, packed=False), _best_ms(repeats, x, ws, packed=True)]
                total = [total[0] + ms[0], total[1] + ms[1]]
                lines.append(f"| {rows} | {name} | {ms[0]:.2f} | {ms[1]:.2f} | {ms[0] / ms[1]:.2f}x |")
            lines.append(f"| {rows} | **all** | {total[0]:.1f} | {total[1]:.1f} | {total[0] / total[1]:.2f}x |")
    text = "\n".join(lines)
    print(text)
    (RESULTS / "profile-linear.txt").write_text(text + "\n")


def run_linear_lowp(args, layers: int = 30, repeats: int = 5) -> None:
    """Decode-sized matmuls per weight format, as the engine runs them: float32 and bfloat16 PackedLinear,
    --quantization int8's Int8Linear (the C++ ragserve::int8_linear on the blocked int8 weight) and torch's
    _weight_int8pack_mm it replaced (the fallback without a compiler), int8 in groups of 32 and int4 (whose
    LM head is grouped int8, as in the engine), with the weight bytes each reads per step and the read rate
    that gives."""
    import torch
    from torch import nn

    from engine import RESULTS
    from ragserve_engine.layers.packed_linear import PackedLinear
    from ragserve_engine.layers.quant_linear import Int4Linear, Int8Linear

    grouped = partial(Int8Linear, grouped=True)
    shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
    formats = {"float32 packed": (torch.float32, PackedLinear, 4), "bfloat16 packed": (torch.bfloat16, PackedLinear, 2),
               "int8 (ragserve::int8_linear)": (torch.float32, Int8Linear, 1),
               "int8 (_weight_int8pack_mm)": (torch.float32, partial(Int8Linear, blocked=False), 1),
               "int8 in groups of 32 (ragserve::int8_group_linear)": (torch.float32, grouped, 1.0625),
               "int4 (ragserve::int4_linear; lm_head grouped int8)": (torch.float32, Int4Linear, 0.625)}  # fmt: skip
    heads = {"int4 (ragserve::int4_linear; lm_head grouped int8)": (grouped, 1.0625)}  # as the engine's int4
    lines = [f"`python bench/engine.py --part lowp` (CPU, {torch.get_num_threads()} threads): ms per decode step "
             f"for all projections of {layers} layers + lm_head (SmolLM2-135M shapes, distinct weights), best of "
             f"{repeats}; GB/s = weight bytes read / time", "",
             "| rows | format | ms | weight MB | GB/s |", "|---:|---|---:|---:|---:|"]  # fmt: skip
    with torch.inference_mode():
        for rows in (1, 8, 32):
            for label, (dtype, *layer) in formats.items():
                ms, nbytes = 0.0, 0
                for name, (n, k) in shapes.items():
                    make, width = heads.get(label, layer) if name == "lm_head" else layer
                    mods = []
                    for _ in range(1 if name == "lm_head" else layers):
                        lin = nn.Linear(k, n, bias=False)
                        lin.weight.data = (torch.randn(n, k) * 0.02).to(dtype)
                        mods.append(make(lin))
                    x = torch.randn(rows, k, dtype=dtype)
                    ms += _best_of(repeats, lambda mods=mods, x=x: [m(x) for m in mods])
                    nbytes += int(len(mods) * n * k * width)
                lines.append(f"| {rows} | {label} | {ms:.1f} | {nbytes / 1e6:.0f} | {nbytes / ms / 1e6:.1f} |")
    text = "\n".join(lines)
    print(text)
    (RESULTS / "profile-linear-lowp.txt").write_text(text + "\n")


def _best_of(repeats: int, fn) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def _best_ms(repeats: int, x, weights: list, packed: bool) -> float:
    """Best time of one pass over all weights: F.linear, or oneDNN's linear on weights packed beforehand."""
    import torch
    import torch.nn.functional as F

    from ragserve_engine.layers.packed_linear import BATCH_HINT

    if packed:
        weights = [torch.ops.mkldnn._reorder_linear_weight(w, BATCH_HINT) for w in weights]
    run = (
        (lambda w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))
        if packed
        else (lambda w: F.linear(x, w))
    )
    times = []
    for _ in range(repeats + 1):  # the first pass warms up
        t0 = time.perf_counter()
        for w in weights:
            run(w)
        times.append(time.perf_counter() - t0)
    return min(times[1:]) * 1e3
