"""oneDNN-prepacked linear layers for CPU (on unless --enforce-eager).

torch's nn.Linear on CPU is an MKL sgemm on the plain [out, in] weight; at decode's small M (1-32 rows)
it runs at a third of the GEMM peak or less. oneDNN's inner-product primitive on a weight reordered
once, at load, into its blocked layout (what inductor's freezing pass does) runs a batch-32 decode
step's matmuls 2.2x faster, a single stream's 1.7x, prefill's 1.27x (bench/results/profile-linear.txt).
The packed weight replaces the plain one (same bytes); a tied lm_head gets its own packed copy, the
embedding keeps the plain table.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ragserve_engine.layers.replace import replace_linears

PACK_DTYPES = (torch.float32, torch.bfloat16)
BATCH_HINT = 32  # the M oneDNN picks the blocked layout for; any M runs on it


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach()
        self.out_features, self.in_features = w.shape
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), BATCH_HINT))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = packed_linear(x.reshape(-1, self.in_features), self.packed, self.bias)
        return y.view(*x.shape[:-1], self.out_features)


@torch.library.custom_op("ragserve::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, in] times the prepacked weight. A custom op, so a compiled decode graph calls it as an
    extern kernel on the one packed copy (inductor's own lowering of the mkldnn op expects to pack itself)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0])


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in PACK_DTYPES and torch.backends.mkldnn.is_available() and _reorders(dtype)


@functools.cache
def _reorders(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN can reorder a weight of `dtype` (bf16 needs AVX-512 or AVX-NE-CONVERT:
    an AVX2-only host refuses it, and its engines keep the plain nn.Linear)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), BATCH_HINT)
    except RuntimeError:
        return False
    return True


def pack_weights(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear (lm_head included) by a PackedLinear."""
    return replace_linears(model, PackedLinear)
