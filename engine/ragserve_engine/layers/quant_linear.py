"""Weight-only int8 linear layers (--quantization int8): memory-bound decode reads a quarter of fp32's bytes.

Symmetric per-output-channel scales, like torchao's int8 weight-only. On CPU, when the C++ ops build
(compilation/cpu_ops.py), the weight is stored blocked as [out / 64, in, 64] for ragserve::int8_linear
(float32 activations; reads the weights at close to memory speed). Otherwise the matmul is torch's
``_weight_int8pack_mm`` with bf16 activations (it reads int8 weights at ~9 GB/s here: docs/kernels.md).
Outputs are in the model dtype, so norms, rotary, attention and the KV cache keep their precision.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ragserve_engine.compilation import cpu_ops

QUANTIZATIONS = ("int8",)
BLOCK = 64  # output channels per block of the C++ kernel's layout (one cache line per input feature)


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear, blocked: bool | None = None) -> None:
        """blocked: the C++ kernel's layout; None: when on CPU and the C++ ops load."""
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        qweight = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.out_features, self.in_features = w.shape
        self.blocked = w.device.type == "cpu" and cpu_ops.load() if blocked is None else blocked
        if self.blocked:
            qweight, scale = block_weight(qweight), F.pad(scale, (0, -self.out_features % BLOCK))
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scale if self.blocked else scale.to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.blocked:
            y = torch.ops.ragserve.int8_linear(flat, self.qweight, self.scales, self.bias, self.out_features)
        else:
            y = torch.ops.aten._weight_int8pack_mm(flat.to(torch.bfloat16), self.qweight, self.scales).to(x.dtype)
            if self.bias is not None:
                y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The float32 [out, in] weight this layer multiplies by."""
        w, s = self.qweight, self.scales.float()
        if self.blocked:
            w = w.permute(0, 2, 1).reshape(-1, self.in_features)
        return (w.float() * s[:, None])[: self.out_features]


def block_weight(qweight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [ceil(out / 64), in, 64]: at each input feature, 64 output channels side by side."""
    out, k = qweight.shape
    padded = F.pad(qweight, (0, 0, 0, -out % BLOCK))
    return padded.view(-1, BLOCK, k).transpose(1, 2).contiguous()


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
