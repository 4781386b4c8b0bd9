"""Triton paged attention for a mixed batch in one launch (prefill, prefill over a cached prefix, decode).

Grid: (query blocks, KV heads, KV splits). A program owns BLOCK_Q query tokens of one sequence times the
GQA query heads of one KV head (BLOCK_M = BLOCK_Q * GQA rows, padded to a power of two), walks that
sequence's KV in tiles of TILE_N positions through the block table (read in-kernel), and keeps an online
softmax in float32. The sequence of a program is found by binary search over query_start_loc, so the
launch needs no host-side schedule. With NUM_SPLITS > 1 (flash-decoding) each split covers a slice of
the tiles and writes an unnormalized partial result; reduce_splits_kernel merges them.
Quantized caches are dequantized in-kernel: int8 per token per head (scales fold into the scores and
the probabilities), fp8 per tensor (scales fold into the softmax scale and the output).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ragserve_engine.attention.triton_utils import round_to_grid

LOG2E = 1.4426950408889634


@triton.jit
def _find_seq_idx(query_start_loc_ptr, target, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose query blocks contain `target` (block i of seq s is numbered start_s // BLOCK_Q + s + i)."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= target:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def paged_attention_kernel(
    out_ptr,
    q_ptr,
    cache_ptr,
    scales_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    part_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_DIM_P] float32 (NUM_SPLITS > 1)
    part_ml_ptr,  # [num_tokens, num_heads, NUM_SPLITS, 2] float32: running max (log2 domain), sum
    qk_scale,  # softmax scale * log2(e) (* fp8 k_scale)
    v_scale,  # fp8 per-tensor V scale (1.0 otherwise)
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ckv,
    stride_ct,
    stride_ch,
    stride_sb,
    stride_skv,
    stride_st,
    stride_sh,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    GQA: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    QUANT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # the query dtype (float32 under the interpreter, whose bf16 dot is wrong)
    DOT_PRECISION: tl.constexpr,
    OUT_MANTISSA: tl.constexpr,  # > 0: round the output to its format first (interpreter only)
    OUT_MIN_EXP: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_seq_idx(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local = q_block - (q_start // BLOCK_Q + seq)
    if local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    cached = seq_len - q_len  # context already in the cache before this step's tokens

    rows = tl.arange(0, BLOCK_M)
    q_pos = local * BLOCK_Q + rows // GQA  # index among this step's tokens of the sequence
    heads = kv_head * GQA + rows % GQA
    row_ok = (rows // GQA < BLOCK_Q) & (q_pos < q_len)
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    tokens = (q_start + q_pos).to(tl.int64)
    q_offs = tokens[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(DOT_DTYPE)

    # causal: row r sees positions <= cached + q_pos[r]; the block's last row bounds the tiles
    last_pos = cached + tl.minimum(local * BLOCK_Q + BLOCK_Q, q_len) - 1
    num_tiles = tl.cdiv(last_pos + 1, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: fully masked rows never produce NaN
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    cache_head = cache_ptr + kv_head.to(tl.int64) * stride_ch
    scales_head = scales_ptr + kv_head.to(tl.int64) * stride_sh
    for tile in range(tile_lo, tile_hi):
        pos = tile * TILE_N + tl.arange(0, TILE_N)
        pos_ok = pos < seq_len
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        slot_off = block * stride_cb + (pos % BLOCK_SIZE).to(tl.int64) * stride_ct
        kv_mask = pos_ok[None, :] & dim_ok[:, None]
        k = tl.load(cache_head + slot_off[None, :] + dims[:, None], mask=kv_mask, other=0.0)  # [D, N]
        s = tl.dot(q, k.to(DOT_DTYPE), input_precision=DOT_PRECISION) * qk_scale
        if QUANT == 2:
            k_scales = tl.load(scales_head + block * stride_sb + (pos % BLOCK_SIZE) * stride_st, mask=pos_ok, other=0.0)
            s = s * k_scales[None, :]
        visible = (pos[None, :] <= cached + q_pos[:, None]) & pos_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if QUANT == 2:
            v_scales = tl.load(
                scales_head + stride_skv + block * stride_sb + (pos % BLOCK_SIZE) * stride_st, mask=pos_ok, other=0.0
            )
            p = p * v_scales[None, :]
        v_offs = stride_ckv + slot_off[:, None] + dims[None, :]
        v = tl.load(cache_head + v_offs, mask=pos_ok[:, None] & dim_ok[None, :], other=0.0)  # [N, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new

    acc = acc * v_scale
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        if OUT_MANTISSA > 0:
            out = round_to_grid(out, OUT_MANTISSA, OUT_MIN_EXP)
        o_offs = tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    else:
        part = (tokens[:, None] * NUM_HEADS + heads[:, None]) * NUM_SPLITS + split
        tl.store(part_out_ptr + part * HEAD_DIM_P + dims[None, :], acc, mask=row_ok[:, None])
        ml = part_ml_ptr + (tokens * NUM_HEADS + heads) * (NUM_SPLITS * 2) + split * 2
        tl.store(ml, m_i, mask=row_ok)
        tl.store(ml + 1, l_i, mask=row_ok)


@triton.jit
def reduce_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_ml_ptr,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    OUT_MANTISSA: tl.constexpr,
    OUT_MIN_EXP: tl.constexpr,
):
    """Merge the splits of one (token, head): rescale each partial sum to the global max."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM_P)
    base = token * NUM_HEADS + head
    m = tl.load(part_ml_ptr + base * (NUM_SPLITS * 2) + splits * 2)
    l_part = tl.load(part_ml_ptr + base * (NUM_SPLITS * 2) + splits * 2 + 1)
    m_max = tl.max(m, axis=0)
    w = tl.math.exp2(m - m_max)
    parts = tl.load(part_out_ptr + (base * NUM_SPLITS + splits[:, None]) * HEAD_DIM_P + dims[None, :])
    out = tl.sum(parts * w[:, None], axis=0) / tl.sum(l_part * w, axis=0)
    if OUT_MANTISSA > 0:
        out = round_to_grid(out, OUT_MANTISSA, OUT_MIN_EXP)
    dst = out_ptr + token * stride_ot + head * stride_oh + dims
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)
