"""Helpers shared by the Triton kernels and their launchers."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def round_to_grid(x, MANTISSA: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr):
    """Round float32 to the nearest (ties to even) value of a narrower float format, so the cast after it
    is exact.

    A GPU's cast does this by itself, but the Triton interpreter's float32 -> fp8/bf16 cast drops the carry
    into the exponent (1.99 -> 1.0); rounding first gives the same bytes on both.
    """
    SHIFT: tl.constexpr = 23 - MANTISSA
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + (((bits >> SHIFT) & 1) + ((1 << (SHIFT - 1)) - 1))
    normal = ((bits >> SHIFT) << SHIFT).to(tl.float32, bitcast=True)
    # below the smallest normal the grid step is fixed: adding a power of two rounds to it
    magic = 2.0 ** (MIN_NORMAL_EXP - MANTISSA + 23)
    sub = (tl.abs(x) + magic) - magic
    sub = tl.where(x < 0, -sub, sub)
    return tl.where(tl.abs(x) < 2.0**MIN_NORMAL_EXP, sub, normal)


def float_format(dtype: torch.dtype) -> tuple[int, int]:
    """(mantissa bits, exponent of the smallest normal) of a floating dtype."""
    info = torch.finfo(dtype)
    return -int(math.log2(info.eps)), int(math.log2(info.smallest_normal))


def kernels_interpreted() -> bool:
    """Whether the kernels were built for the interpreter (decided when Triton decorates them, at import)."""
    return type(round_to_grid).__name__ == "InterpretedFunction"


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
