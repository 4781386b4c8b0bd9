"""Weight-only int8 linear layers (--quantization int8): memory-bound decode reads a quarter of fp32's bytes.

Symmetric per-output-channel scales, like torchao's int8 weight-only. The matmul is torch's
``_weight_int8pack_mm`` with bf16 activations (its fast CPU path: avx512_bf16/AMX); outputs are cast
back to the model dtype, so norms, rotary, attention and the KV cache keep their precision.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

QUANTIZATIONS = ("int8",)


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scale.to(torch.bfloat16))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.out_features, self.in_features = w.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> nn.Module:
    """Replace every nn.Linear (lm_head included; a tied embedding keeps its own full-precision copy)."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, make(child))
    return model


def quantize_weights(model: nn.Module, method: str) -> nn.Module:
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {method!r}")
    return replace_linears(model, Int8Linear)
