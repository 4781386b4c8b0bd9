"""GPU check of the Triton attention kernels and the FP8/INT8 KV cache (issue 4). One script, a few minutes on an H200.

1. Correctness on the device: Triton vs the torch reference backend on mixed batches (decode, prefill over a
   cached prefix, fresh prefill), GQA 1 and 4, block sizes 16 and 32, split-KV, KV dtypes auto/fp8/int8,
   head dims 64/128, block ids past 2**31 elements.
2. Paged decode attention, batch 64 x context 4k (Llama-3-8B heads: 32 query, 8 KV, head_dim 128, bf16):
   achieved bandwidth as a fraction of HBM peak (H200: 4.8 TB/s), against torch SDPA on contiguous KV (and
   FlashAttention when importable) in the same run; fp8/int8 caches; split-KV for few long sequences.
3. End-to-end decode throughput of a Llama-3-8B-shaped model with random bf16 weights through the engine's
   layers and a paged cache: KV cache auto vs fp8 (and int8), ratio printed.

    python bench/kernels_gpu.py                # on a CUDA machine -> bench/results/kernels_gpu.{json,md}
    python bench/kernels_gpu.py --cpu-smoke    # tiny shapes, Triton interpreter: proves the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

MIXED = [(1, 37), (5, 18), (17, 129)]
LLAMA3_8B = dict(
    model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
    num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position=8192,
)  # fmt: skip
TINY = dict(
    model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, max_position=512,
)  # fmt: skip


@dataclass
class Plan:
    device: str
    head_dims: tuple[int, ...]
    batch: int  # decode bandwidth
    context: int
    heads: tuple[int, int, int]  # query heads, KV heads, head dim
    long_batch: int  # split-KV case: few sequences, long context
    long_context: int
    iters: int
    model: dict = field(default_factory=dict)
    e2e_batch: int = 64
    e2e_prompt: int = 2048
    e2e_steps: int = 64
    prefill_chunk: int = 8  # sequences per prefill forward
    peak_bytes_per_s: float = 4.8e12
    large_ids: bool = True


GPU = Plan("cuda", (64, 128), 64, 4096, (32, 8, 128), 2, 32768, 50, LLAMA3_8B)
SMOKE = Plan("cpu", (16, 64), 2, 64, (4, 2, 32), 1, 512, 2, TINY, 2, 20, 4, 1)


def timed(fn, iters: int, device: str) -> float:
    """Mean seconds per call, after one warm-up call (compiles the kernels)."""
    import torch

    fn()
    if device != "cuda":
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t) / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def environment(plan: Plan) -> dict:
    import torch
    import triton

    env = {"torch": torch.__version__, "triton": triton.__version__, "device": plan.device}
    if plan.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(name=props.name, sms=props.multi_processor_count, capability=f"{props.major}.{props.minor}")
    env["flash_attn"] = _flash_attn() is not None
    return env


# ---- 1. correctness ---------------------------------------------------------------------------------------------
def correctness(plan: Plan) -> list[dict]:
    import torch

    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for kv_dtype in ("auto", "fp8", "int8"):
            for gqa, block_size, splits in ((1, 16, None), (4, 32, None), (4, 16, 4)):
                rows.append(_check(plan, MIXED, dtype, kv_dtype, gqa, block_size, splits, plan.head_dims[0]))
    for head_dim in plan.head_dims[1:]:
        rows.append(_check(plan, MIXED, torch.bfloat16, "int8", 4, 16, None, head_dim))
    decode = [(1, 700), (1, 37), (1, 5)]  # the split-KV heuristic kicks in
    rows.append(_check(plan, decode, torch.bfloat16, "fp8", 4, 16, None, plan.head_dims[-1]))
    if plan.large_ids:
        rows += [_check_large_ids(plan, kv_dtype) for kv_dtype in ("auto", "int8")]
    return rows


def _check(plan, cases, dtype, kv_dtype, gqa, block_size, splits, head_dim, **batch_kw) -> dict:
    import torch

    from ragserve_engine.attention.paged_batch import make_paged_batch
    from ragserve_engine.attention.torch_ref import TorchAttentionBackend
    from ragserve_engine.attention.triton_backend import TritonAttentionBackend

    batch = make_paged_batch(
        cases, num_heads=2 * gqa, num_kv_heads=2, head_dim=head_dim, block_size=block_size, kv_dtype=kv_dtype,
        dtype=dtype, device=plan.device, **batch_kw,
    )  # fmt: skip
    outs, caches = [], []
    for impl in (TorchAttentionBackend(), TritonAttentionBackend(num_splits=splits)):
        kv = batch.clone_kv() if not batch_kw else batch.kv_cache
        cache = batch.cache(kv)
        impl.write_kv(batch.key, batch.value, cache, batch.meta.slot_mapping)
        out = impl.forward(batch.query, batch.key, batch.value, cache, batch.meta, head_dim**-0.5)
        outs.append(out[: batch.num_real_tokens].float())
        ids = batch.meta.block_tables.flatten().long()
        caches.append(kv.data[ids, batch.layer].float())
    err = (outs[0] - outs[1]).abs().max().item()
    cache_diff = (caches[0] - caches[1]).abs().max().item()
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    cache_tol = 1.0 if kv_dtype == "int8" else 0.0  # int8: a division may round one step apart on the GPU
    return dict(
        cases=str(cases), dtype=str(dtype).removeprefix("torch."), kv_dtype=kv_dtype, gqa=gqa,
        block_size=block_size, splits=splits, head_dim=head_dim, large_ids=bool(batch_kw),
        max_abs_err=err, cache_max_diff=cache_diff, ok=err <= tol and cache_diff <= cache_tol,
    )  # fmt: skip


def _check_large_ids(plan: Plan, kv_dtype: str) -> dict:
    """Block id * block stride > 2**31 elements (the reference and Triton share the cache: written twice)."""
    import torch

    from ragserve_engine.attention.paged_batch import lazy_kv_cache

    shape = (32_800, 16, 2, 16, 2, 64)
    kv = lazy_kv_cache(kv_dtype, torch.bfloat16, shape, plan.device)
    kw = dict(first_block=32_770, num_blocks=32_800, kv_cache=kv, layer=15)
    row = _check(plan, [(1, 40), (6, 20)], torch.bfloat16, kv_dtype, 2, 16, None, 64, **kw)
    del kv
    return row


# ---- 2. decode bandwidth ----------------------------------------------------------------------------------------
def decode_bandwidth(plan: Plan) -> list[dict]:
    rows = []
    for case, batch, ctx in (("batch", plan.batch, plan.context), ("long", plan.long_batch, plan.long_context)):
        rows += _dense_baselines(plan, case, batch, ctx)
        for kv_dtype in ("auto", "fp8", "int8"):
            rows += _paged_rows(plan, case, batch, ctx, kv_dtype)
    sdpa = {r["case"]: r["seconds"] for r in rows if r["impl"].startswith("torch SDPA")}
    for r in rows:
        r["speedup_vs_sdpa"] = round(sdpa[r["case"]] / r["seconds"], 3)
    return rows


def _dense_baselines(plan: Plan, case: str, batch: int, ctx: int) -> list[dict]:
    """torch SDPA (and FlashAttention) decode over contiguous bf16 K/V of the same shape."""
    import torch
    import torch.nn.functional as F

    num_heads, num_kv_heads, head_dim = plan.heads
    dev = plan.device
    q = torch.randn(batch, num_heads, 1, head_dim, dtype=torch.bfloat16, device=dev)
    k = torch.randn(batch, num_kv_heads, ctx, head_dim, dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    nbytes = 2 * k.nbytes
    t = timed(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), plan.iters, dev)
    rows = [_bw_row(plan, case, batch, ctx, "torch SDPA, contiguous KV", nbytes, t)]
    flash = _flash_attn()
    if flash is not None and dev == "cuda":
        qf, kf, vf = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        t = timed(lambda: flash(qf, kf, vf, cache_seqlens=lens), plan.iters, dev)
        rows.append(_bw_row(plan, case, batch, ctx, "FlashAttention, contiguous KV", nbytes, t))
    return rows


def _paged_rows(plan: Plan, case: str, batch: int, ctx: int, kv_dtype: str) -> list[dict]:
    import torch

    from ragserve_engine.attention.triton_backend import TritonAttentionBackend

    num_heads, num_kv_heads, head_dim = plan.heads
    q = torch.randn(batch, num_heads, head_dim, dtype=torch.bfloat16, device=plan.device)
    layer, meta, nbytes = _paged_decode_setup(batch, ctx, num_kv_heads, head_dim, kv_dtype, torch.bfloat16, plan.device)
    configs = {"Triton paged": TritonAttentionBackend()}
    if kv_dtype == "auto" and case == "long":
        configs["Triton paged, no split"] = TritonAttentionBackend(num_splits=1)
    elif kv_dtype == "auto":
        configs |= {f"Triton paged, tile {n}": TritonAttentionBackend(tile_n=n) for n in (64, 128)}
    rows = []
    for name, backend in configs.items():
        t = timed(lambda b=backend: b.forward(q, None, None, layer, meta, head_dim**-0.5), plan.iters, plan.device)
        rows.append(_bw_row(plan, case, batch, ctx, f"{name}, {kv_dtype} KV", nbytes, t))
    return rows


def _paged_decode_setup(batch, ctx, num_kv_heads, head_dim, kv_dtype, dtype, dev):
    import torch

    from ragserve_engine.attention.backend import AttentionMetadata
    from ragserve_engine.attention.kv_cache import allocate_kv_cache

    block_size = 16
    per_seq = -(-ctx // block_size)
    num_blocks = batch * per_seq + 1
    kv = allocate_kv_cache(kv_dtype, dtype, (num_blocks, 1, 2, block_size, num_kv_heads, head_dim), dev)
    if kv.data.dtype == torch.int8:
        kv.data.copy_(torch.randint(-127, 128, kv.data.shape, dtype=torch.int8, device=dev))
        kv.scales.uniform_(1e-3, 2e-2)
    else:
        kv.data.copy_(torch.randn(kv.data.shape, dtype=dtype, device=dev).to(kv.data.dtype))
    tables = (torch.randperm(num_blocks - 1, device=dev) + 1).view(batch, per_seq).to(torch.int32)
    starts = list(range(batch + 1))
    meta = AttentionMetadata(
        slot_mapping=torch.full((batch,), -1, dtype=torch.int64, device=dev),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=dev),
        block_tables=tables, max_query_len=1, max_seq_len=ctx, query_start_loc_cpu=starts, seq_lens_cpu=[ctx] * batch,
    )  # fmt: skip
    nbytes = 2 * batch * ctx * num_kv_heads * head_dim * kv.data.element_size()
    if kv.scales is not None:
        nbytes += 2 * batch * ctx * num_kv_heads * kv.scales.element_size()
    return kv.layers()[0], meta, nbytes


def _bw_row(plan: Plan, case: str, batch: int, ctx: int, impl: str, nbytes: int, seconds: float) -> dict:
    rate = nbytes / seconds
    return dict(
        case=case, batch=batch, context=ctx, impl=impl, kv_bytes=nbytes, seconds=seconds,
        gb_per_s=round(rate / 1e9, 1), fraction_of_peak=round(rate / plan.peak_bytes_per_s, 3),
    )  # fmt: skip


def _flash_attn():
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        return None
    return flash_attn_with_kvcache


# ---- 3. end-to-end decode ---------------------------------------------------------------------------------------
def e2e_decode(plan: Plan) -> list[dict]:
    import torch

    from ragserve_engine.attention.selector import get_attention_backend
    from ragserve_engine.models.config import ModelConfig
    from ragserve_engine.models.llama import LlamaForCausalLM

    dev, dtype = torch.device(plan.device), torch.bfloat16
    cfg = ModelConfig(**plan.model)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with dev:
            model = LlamaForCausalLM(cfg).eval()  # random weights
    finally:
        torch.set_default_dtype(default)
    backend = get_attention_backend("triton", dev)
    rows, tokens = [], {}
    for kv_dtype in ("auto", "fp8", "int8"):
        row, tokens[kv_dtype] = _decode_run(model, cfg, backend, kv_dtype, plan, dev, dtype)
        rows.append(row)
        if dev.type == "cuda":
            torch.cuda.empty_cache()  # the previous cache is garbage now
    for r in rows:
        r["decode_speedup_vs_auto"] = round(r["decode_tokens_per_s"] / rows[0]["decode_tokens_per_s"], 3)
        r["token_agreement_vs_auto"] = round((tokens[r["kv_dtype"]] == tokens["auto"]).float().mean().item(), 3)
    return rows


def _decode_run(model, cfg, backend, kv_dtype: str, plan: Plan, dev, dtype) -> tuple[dict, object]:
    """Prefill e2e_batch random prompts (in chunks), then decode e2e_steps tokens for all of them, greedy."""
    import torch

    from ragserve_engine.attention.backend import AttentionMetadata
    from ragserve_engine.attention.kv_cache import allocate_kv_cache
    from ragserve_engine.layers.attention import ForwardContext

    batch, prompt, steps, bs = plan.e2e_batch, plan.e2e_prompt, plan.e2e_steps, 16
    per_seq = -(-(prompt + steps) // bs)
    shape = (batch * per_seq + 1, cfg.num_layers, 2, bs, cfg.num_kv_heads, cfg.head_dim)
    kv = allocate_kv_cache(kv_dtype, dtype, shape, dev)
    layers = kv.layers()
    tables = torch.arange(1, batch * per_seq + 1, dtype=torch.int32, device=dev).view(batch, per_seq)
    prompts = torch.randint(0, cfg.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(1))

    def forward(seqs: list[int], start: int, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        pos = torch.arange(start, start + n, device=dev).repeat(len(seqs), 1)
        table = tables[seqs]
        slots = (table.gather(1, pos // bs).long() * bs + pos % bs).flatten()
        starts, lens = [i * n for i in range(len(seqs) + 1)], [start + n] * len(seqs)
        as_int32 = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)  # noqa: E731
        meta = AttentionMetadata(
            slots, as_int32(starts), as_int32(lens), table.contiguous(), n, start + n, starts, lens
        )
        hidden = model(ids.to(dev).flatten(), pos.flatten(), ForwardContext(meta, backend, layers))
        return model.compute_logits(hidden.view(len(seqs), n, -1)[:, -1]).argmax(-1)

    with torch.inference_mode():
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        forward([0], 0, prompts[[0], :16])  # compiles the prefill kernels (seq 0 is prefilled again below)
        sync()
        t0 = time.perf_counter()
        chunks = [list(range(c, min(batch, c + plan.prefill_chunk))) for c in range(0, batch, plan.prefill_chunk)]
        out = [torch.cat([forward(seqs, 0, prompts[seqs]) for seqs in chunks])]
        out.append(forward(list(range(batch)), prompt, out[-1].view(batch, 1)))  # compiles the decode kernels
        sync()
        t1 = time.perf_counter()
        for i in range(1, steps - 1):
            out.append(forward(list(range(batch)), prompt + i, out[-1].view(batch, 1)))
        sync()
        t2 = time.perf_counter()
    row = dict(
        kv_dtype=kv_dtype, batch=batch, prompt=prompt, steps=steps,
        kv_cache_gib=round((kv.data.nbytes + (kv.scales.nbytes if kv.scales is not None else 0)) / 2**30, 2),
        prefill_tokens_per_s=round(batch * prompt / (t1 - t0), 1),  # includes one decode step
        decode_tokens_per_s=round(batch * (steps - 2) / (t2 - t1), 1),
    )  # fmt: skip
    return row, torch.stack(out, 1).cpu()


# ---- report -----------------------------------------------------------------------------------------------------
def markdown(results: dict) -> str:
    env, lines = results["environment"], []
    smoke = env["device"] != "cuda"
    lines.append(
        f"# Triton kernels GPU check{' (CPU SMOKE RUN: interpreter, tiny shapes, timings meaningless)' * smoke}"
    )
    lines.append(f"\n{json.dumps(env)}; wall {results['wall_s']} s\n")
    checks = results["correctness"]
    bad = [c for c in checks if not c["ok"]]
    lines.append(f"## Correctness vs the torch reference: {len(checks) - len(bad)}/{len(checks)} ok\n")
    lines.append("| dtype | kv | gqa | block | splits | head_dim | large ids | max abs err | cache diff | ok |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for c in checks:
        lines.append(
            f"| {c['dtype']} | {c['kv_dtype']} | {c['gqa']} | {c['block_size']} | {c['splits']} | {c['head_dim']} "
            f"| {c['large_ids']} | {c['max_abs_err']:.2e} | {c['cache_max_diff']:.0f} | {c['ok']} |"
        )
    lines.append("\n## Decode attention bandwidth (bf16 queries, block size 16)\n")
    lines.append("| case | batch x ctx | implementation | us | GB/s | of HBM peak | vs SDPA |")
    lines.append("|---|---|---|---|---|---|---|")
    for r in results["decode_bandwidth"]:
        lines.append(
            f"| {r['case']} | {r['batch']} x {r['context']} | {r['impl']} | {r['seconds'] * 1e6:.1f} "
            f"| {r['gb_per_s']} | {r['fraction_of_peak']:.1%} | {r['speedup_vs_sdpa']:.2f}x |"
        )
    if "e2e_decode" in results:
        m = results["plan"]["model"]
        shape = f"{m['num_layers']} layers, hidden {m['hidden_size']}, {m['num_heads']}/{m['num_kv_heads']} heads"
        lines.append(f"\n## End-to-end decode, random weights ({shape}), bf16, Triton backend\n")
        lines.append(
            "| KV cache | batch | prompt | KV GiB | prefill tok/s | decode tok/s | vs auto | token agreement |"
        )
        lines.append("|---|---|---|---|---|---|---|---|")
        for r in results["e2e_decode"]:
            lines.append(
                f"| {r['kv_dtype']} | {r['batch']} | {r['prompt']} | {r['kv_cache_gib']} "
                f"| {r['prefill_tokens_per_s']} | {r['decode_tokens_per_s']} | {r['decode_speedup_vs_auto']:.2f}x "
                f"| {r['token_agreement_vs_auto']:.1%} |"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--skip-e2e", action="store_true")
    args = parser.parse_args()
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-smoke to exercise the script on CPU", file=sys.stderr)
        return 2
    plan = SMOKE if args.cpu_smoke else GPU
    results = {"plan": asdict(plan), "environment": environment(plan)}
    t0 = time.perf_counter()
    results["correctness"] = correctness(plan)
    results["decode_bandwidth"] = decode_bandwidth(plan)
    if not args.skip_e2e:
        results["e2e_decode"] = e2e_decode(plan)
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "kernels_gpu_cpu_smoke" if args.cpu_smoke else "kernels_gpu"
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2))
    report = markdown(results)
    (out / f"{stem}.md").write_text(report)
    print(report)
    failed = [r for r in results["correctness"] if not r["ok"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
