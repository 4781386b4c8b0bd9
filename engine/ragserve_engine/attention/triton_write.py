"""Triton KV-cache write (vLLM's reshape_and_cache): scatter new K/V into their slots, quantizing on the way.

One program per token: all of its KV heads, K and V. Slot -1 (padding) is skipped.
Addresses are computed in int64 so block ids times the block stride never overflow.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ragserve_engine.attention import quant
from ragserve_engine.attention.backend import LayerKVCache
from ragserve_engine.attention.triton_utils import float_format, last_dim_contiguous, round_to_grid


@triton.jit
def _store_quantized(
    x,  # [BLOCK_H, HEAD_DIM_P] float32
    dst,  # pointers into the cache
    scale_dst,  # [BLOCK_H] pointers into the scales (QUANT == 2)
    mask,
    head_mask,
    scale,  # per-tensor scale (QUANT == 1)
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANTISSA: tl.constexpr,
    FP8_MIN_EXP: tl.constexpr,
):
    if QUANT == 0:
        tl.store(dst, x.to(dst.dtype.element_ty), mask=mask)
    elif QUANT == 1:
        y = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
        y = round_to_grid(y, FP8_MANTISSA, FP8_MIN_EXP)
        tl.store(dst, y.to(dst.dtype.element_ty), mask=mask)
    else:
        row_scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-8) / 127.0
        y = tl.floor(x / row_scale[:, None] + 0.5)
        y = tl.minimum(tl.maximum(y, -127.0), 127.0)
        tl.store(dst, y.to(tl.int8), mask=mask)
        tl.store(scale_dst, row_scale, mask=head_mask)


@triton.jit
def write_kv_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    scales_ptr,
    slot_mapping_ptr,
    k_scale,
    v_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ckv,
    stride_ct,
    stride_ch,
    stride_sb,
    stride_skv,
    stride_st,
    stride_sh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANTISSA: tl.constexpr,
    FP8_MIN_EXP: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_DIM_P)
    head_mask = heads < NUM_KV_HEADS
    mask = head_mask[:, None] & (dims[None, :] < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask, other=0.0)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask, other=0.0)
    dst = cache_ptr + block * stride_cb + offset * stride_ct + heads[:, None] * stride_ch + dims[None, :]
    scale_dst = scales_ptr + block * stride_sb + offset * stride_st + heads * stride_sh
    _store_quantized(
        k.to(tl.float32), dst, scale_dst, mask, head_mask, k_scale, QUANT, FP8_MAX, FP8_MANTISSA, FP8_MIN_EXP
    )
    v_dst, v_scale_dst = dst + stride_ckv, scale_dst + stride_skv
    _store_quantized(
        v.to(tl.float32), v_dst, v_scale_dst, mask, head_mask, v_scale, QUANT, FP8_MAX, FP8_MANTISSA, FP8_MIN_EXP
    )


def write_kv(key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
    """key/value: [num_tokens, num_kv_heads, head_dim] (last dim contiguous); slot -1 is skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    data = cache.data
    scales = cache.scales if cache.scales is not None else data  # unused unless int8
    s_strides = cache.scales.stride() if cache.scales is not None else (0, 0, 0, 0)
    key, value = last_dim_contiguous(key), last_dim_contiguous(value)
    write_kv_kernel[(num_tokens,)](
        key, value, data, scales, slot_mapping,
        float(cache.k_scale), float(cache.v_scale),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        data.stride(0), data.stride(1), data.stride(2), data.stride(3),
        *s_strides,
        **write_constexprs(num_kv_heads, head_dim, cache.block_size, cache.kv_dtype, data.dtype),
    )  # fmt: skip


def write_constexprs(num_kv_heads: int, head_dim: int, block_size: int, kv_dtype: str, cache_dtype: torch.dtype):
    """The compile-time parameters of write_kv_kernel."""
    mode = quant.quant_mode(kv_dtype)
    fp8 = cache_dtype if mode == quant.QUANT_PER_TENSOR else torch.float8_e4m3fn  # unused unless fp8
    mantissa, min_exp = float_format(fp8)
    return dict(
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEAD_DIM_P=triton.next_power_of_2(head_dim),
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_SIZE=block_size, QUANT=mode,
        FP8_MAX=float(torch.finfo(fp8).max), FP8_MANTISSA=mantissa, FP8_MIN_EXP=min_exp,
    )  # fmt: skip
