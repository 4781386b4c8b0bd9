"""Compile the Triton kernels for a CUDA target without a GPU (Triton's compiler and bundled ptxas).

The interpreter accepts Python the compiler rejects (star-args, data-dependent shapes, ...); this catches
that on machines without a GPU. It compiles the configurations the backend launches: model dtypes x KV
dtypes x decode/prefill x split-KV, for Llama-like and tiny head shapes.

    python -m ragserve_engine.attention.compile_check [--arch 90] [--quick]

Run it without TRITON_INTERPRET (the kernels are built for the interpreter when that is set at import).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import torch

from ragserve_engine.attention import quant
from ragserve_engine.attention.triton_utils import kernels_interpreted

_TYPES = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5", torch.int8: "i8",
}  # fmt: skip
# (num_heads, num_kv_heads, head_dim, block_size): Llama-3-8B, SmolLM2 (GQA 3), the tiny test models
SHAPES = [(32, 8, 128, 16), (9, 3, 64, 32), (4, 2, 16, 16)]


def configs(quick: bool):
    dtypes = [torch.bfloat16] if quick else [torch.bfloat16, torch.float16, torch.float32]
    kv_dtypes = ["auto", "fp8", "fp8_e5m2", "int8"]
    shapes = SHAPES[:1] if quick else SHAPES
    for dtype, kv_dtype, shape in itertools.product(dtypes, kv_dtypes, shapes):
        for decode_only, splits in ((False, 1), (True, 1), (True, 8)):
            yield dtype, kv_dtype, shape, decode_only, splits


def compile_all(arch: int, quick: bool) -> list[str]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ragserve_engine.attention.triton_attention import paged_attention_kernel, reduce_splits_kernel
    from ragserve_engine.attention.triton_backend import attention_constexprs, default_tile_n, reduce_constexprs
    from ragserve_engine.attention.triton_write import write_constexprs, write_kv_kernel

    target, failures, seen = GPUTarget("cuda", arch, 32), [], set()

    def build(fn, pointers: dict, scalars: dict, constexprs: dict, label: str) -> None:
        key = (fn.__name__, tuple(sorted(pointers.items())), tuple(sorted(map(str, constexprs.items()))))
        if key in seen:
            return
        seen.add(key)
        sig = {n: "constexpr" if n in constexprs else pointers.get(n) or scalars.get(n, "i32") for n in fn.arg_names}
        try:
            triton.compile(ASTSource(fn, sig, constexprs), target=target, options={"num_warps": 4})
        except Exception as exc:  # noqa: BLE001 - report every failing configuration
            failures.append(f"{fn.__name__} {label}: {type(exc).__name__}: {str(exc).splitlines()[0:3]}")

    skipped = 0
    for dtype, kv_dtype, (heads, kv_heads, head_dim, bs), decode_only, splits in configs(quick):
        if quant.canonical(kv_dtype) == "fp8_e4m3" and arch < 89:  # the backend refuses it there
            skipped += 1
            continue
        cache_t = _TYPES[quant.storage_dtype(kv_dtype, dtype)]
        scale_t = "*fp32" if quant.has_scale_tensor(kv_dtype) else f"*{cache_t}"
        label = (
            f"{_TYPES[dtype]} kv={kv_dtype} heads={heads}/{kv_heads}x{head_dim} bs={bs} decode={decode_only} s={splits}"
        )
        cx = attention_constexprs(
            dtype, heads, kv_heads, head_dim, bs, kv_dtype, decode_only, splits, default_tile_n(bs), False
        )
        part_t = "*fp32" if splits > 1 else f"*{_TYPES[dtype]}"
        pointers = dict(out_ptr=f"*{_TYPES[dtype]}", q_ptr=f"*{_TYPES[dtype]}", cache_ptr=f"*{cache_t}")
        pointers |= dict(scales_ptr=scale_t, part_out_ptr=part_t, part_ml_ptr=part_t)
        pointers |= dict(block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32")
        build(paged_attention_kernel, pointers, dict(qk_scale="fp32", v_scale="fp32", stride_cb="i64"), cx, label)
        if splits > 1:
            reduce_ptrs = dict(out_ptr=f"*{_TYPES[dtype]}", part_out_ptr="*fp32", part_ml_ptr="*fp32")
            build(reduce_splits_kernel, reduce_ptrs, {}, reduce_constexprs(cx), label)
        write_ptrs = dict(key_ptr=f"*{_TYPES[dtype]}", value_ptr=f"*{_TYPES[dtype]}", cache_ptr=f"*{cache_t}")
        write_ptrs |= dict(scales_ptr=scale_t, slot_mapping_ptr="*i64")
        wcx = write_constexprs(kv_heads, head_dim, bs, kv_dtype, quant.storage_dtype(kv_dtype, dtype))
        build(write_kv_kernel, write_ptrs, dict(k_scale="fp32", v_scale="fp32"), wcx, label)
    print(f"compiled {len(seen)} kernel configurations for sm_{arch}: {len(failures)} failed")
    if skipped:
        print(f"skipped {skipped} fp8_e4m3 launches: e4m3 needs sm_89+ (the backend refuses it with a clear error)")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80, 90")
    parser.add_argument("--quick", action="store_true", help="bf16 and the Llama-3-8B shape only")
    args = parser.parse_args(argv)
    if kernels_interpreted():
        print("TRITON_INTERPRET=1 is set: unset it to compile the kernels", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    failures = compile_all(args.arch, args.quick)
    for line in failures:
        print("FAILED", line)
    print(f"{time.perf_counter() - t0:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
