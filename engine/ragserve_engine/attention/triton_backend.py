"""Triton attention backend: the KV write and paged-attention kernels behind the backend interface.

Launch choices (all derived from the step's metadata, no device sync):
- BLOCK_M query rows per program: 16 for decode-only steps, 64 when a prefill is in the batch, at least
  the GQA group size; BLOCK_Q = BLOCK_M // GQA query tokens.
- TILE_N KV positions per loop iteration (several pages when the block size is small).
- KV splits (flash-decoding): decode-only steps whose (sequence, KV head) programs cannot fill the GPU
  split each context into up to 32 slices of at least MIN_TILES_PER_SPLIT tiles, then merge them.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ragserve_engine.attention import quant
from ragserve_engine.attention.backend import AttentionMetadata, LayerKVCache
from ragserve_engine.attention.triton_attention import LOG2E, paged_attention_kernel, reduce_splits_kernel
from ragserve_engine.attention.triton_utils import float_format, kernels_interpreted, last_dim_contiguous
from ragserve_engine.attention.triton_write import write_kv

MAX_SPLITS = 32
MIN_TILES_PER_SPLIT = 4
CPU_NUM_SMS = 8  # the interpreter has no SMs; a small number keeps CPU runs cheap
FP8_E4M3_MIN_CAPABILITY = (8, 9)  # Triton converts e4m3 natively from Ada on


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, num_splits: int | None = None, tile_n: int | None = None) -> None:
        """num_splits: None = heuristic, 1 = never split, N (a power of two) = always N splits."""
        if num_splits is not None and (num_splits < 1 or num_splits & (num_splits - 1)):
            raise ValueError(f"num_splits must be a power of two, got {num_splits}")
        if tile_n is not None and (tile_n < 16 or tile_n & (tile_n - 1)):
            raise ValueError(f"tile_n must be a power of two >= 16, got {tile_n}")
        self.num_splits, self.tile_n = num_splits, tile_n
        self._num_sms: dict[torch.device, int] = {}
        self._checked: set[tuple[str, torch.device]] = set()

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
        if (cache.kv_dtype, key.device) not in self._checked:
            if reason := unsupported_reason(cache.kv_dtype, key.device):
                raise ValueError(reason)
            self._checked.add((cache.kv_dtype, key.device))
        with _on_device(key.device):
            write_kv(key, value, cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        with _on_device(query.device):
            return self._forward(last_dim_contiguous(query), cache, meta, scale)

    def _forward(self, query: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        num_tokens, num_heads, head_dim = query.shape
        out = torch.empty_like(query)
        if num_tokens == 0:
            return out
        data = cache.data
        num_kv_heads = data.shape[3]
        tile_n = self.tile_n or default_tile_n(cache.block_size)
        splits = self._splits(meta, num_kv_heads, tile_n, query.device)
        cx = attention_constexprs(
            query.dtype, num_heads, num_kv_heads, head_dim, cache.block_size, cache.kv_dtype,
            meta.max_query_len == 1, splits, tile_n, kernels_interpreted(),
        )  # fmt: skip
        per_tensor = cx["QUANT"] == quant.QUANT_PER_TENSOR
        parts = ml = out  # placeholders when not split
        if splits > 1:
            shape = (num_tokens, num_heads, splits)
            parts = torch.empty(*shape, cx["HEAD_DIM_P"], dtype=torch.float32, device=query.device)
            ml = torch.empty(*shape, 2, dtype=torch.float32, device=query.device)
        scales = cache.scales if cache.scales is not None else data
        s_strides = cache.scales.stride() if cache.scales is not None else (0, 0, 0, 0)
        grid = (num_tokens // cx["BLOCK_Q"] + meta.num_seqs, num_kv_heads, splits)
        paged_attention_kernel[grid](
            out, query, data, scales, meta.block_tables, meta.seq_lens, meta.query_start_loc, parts, ml,
            scale * LOG2E * (cache.k_scale if per_tensor else 1.0),
            cache.v_scale if per_tensor else 1.0,
            meta.num_seqs,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            data.stride(0), data.stride(1), data.stride(2), data.stride(3),
            *s_strides,
            meta.block_tables.stride(0),
            **cx,
        )  # fmt: skip
        if splits > 1:
            reduce_splits_kernel[(num_tokens, num_heads)](
                out, parts, ml, out.stride(0), out.stride(1), **reduce_constexprs(cx)
            )  # fmt: skip
        return out

    def _splits(self, meta: AttentionMetadata, num_kv_heads: int, tile_n: int, device: torch.device) -> int:
        if self.num_splits is not None:
            return self.num_splits
        if meta.max_query_len != 1:
            return 1
        programs = meta.num_seqs * num_kv_heads
        by_occupancy = -(-2 * self.num_sms(device) // programs)
        by_length = meta.max_seq_len // (tile_n * MIN_TILES_PER_SPLIT)
        splits = min(by_occupancy, by_length, MAX_SPLITS)
        return 1 if splits < 2 else 1 << (splits.bit_length() - 1)

    def num_sms(self, device: torch.device) -> int:
        if device.type != "cuda":
            return CPU_NUM_SMS
        if device not in self._num_sms:
            self._num_sms[device] = torch.cuda.get_device_properties(device).multi_processor_count
        return self._num_sms[device]


def unsupported_reason(kv_dtype: str, device: torch.device) -> str | None:
    """Why the kernels cannot serve this KV cache dtype on this device (None: they can)."""
    if device.type != "cuda" or quant.canonical(kv_dtype) != "fp8_e4m3":
        return None
    if torch.cuda.get_device_capability(device) >= FP8_E4M3_MIN_CAPABILITY:
        return None
    return (
        "the fp8 (e4m3) KV cache needs compute capability >= 8.9 (Ada, Hopper) for the Triton kernels; "
        "use --kv-cache-dtype fp8_e5m2 or int8, or --attention-backend torch"
    )


def _on_device(device: torch.device):
    """Triton launches on the current CUDA device: make it the tensors' device."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def default_tile_n(block_size: int) -> int:
    return min(max(block_size, 32), 64)


def attention_constexprs(
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    kv_dtype: str,
    decode_only: bool,
    splits: int,
    tile_n: int,
    interpreted: bool,
) -> dict:
    """The compile-time parameters of paged_attention_kernel for one launch."""
    gqa = num_heads // num_kv_heads
    block_m = max(16 if decode_only else 64, triton.next_power_of_2(gqa))
    # the interpreter's bf16/fp16 casts and dots are wrong: float32 dots, outputs rounded before the cast
    emulate = interpreted and dtype != torch.float32
    mantissa, min_exp = float_format(dtype) if emulate else (0, 0)
    return dict(
        NUM_HEADS=num_heads, GQA=gqa, HEAD_DIM=head_dim, HEAD_DIM_P=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, TILE_N=tile_n, BLOCK_M=block_m, BLOCK_Q=block_m // gqa, NUM_SPLITS=splits,
        QUANT=quant.quant_mode(kv_dtype), DOT_DTYPE=_TL_DTYPES[torch.float32 if emulate else dtype],
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32", OUT_MANTISSA=mantissa, OUT_MIN_EXP=min_exp,
    )  # fmt: skip


def reduce_constexprs(cx: dict) -> dict:
    names = ("NUM_HEADS", "HEAD_DIM", "HEAD_DIM_P", "NUM_SPLITS", "OUT_MANTISSA", "OUT_MIN_EXP")
    return {k: cx[k] for k in names}


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
