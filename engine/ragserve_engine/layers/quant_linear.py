"""Weight-only quantized linear layers: memory-bound decode reads a quarter (int8) or ~a sixth (int4) of
fp32's bytes. Outputs are in the model dtype, so norms, rotary, attention and the KV cache keep their
precision.

int8: symmetric per-output-channel scales, like torchao's int8 weight-only. On CPU, when the C++ ops build
(compilation/cpu_ops.py), the weight is stored blocked as [out / 64, in, 64] for ragserve::int8_linear
(float32 activations; reads the weights at close to memory speed). Otherwise the matmul is torch's
``_weight_int8pack_mm`` with bf16 activations (it reads int8 weights at ~9 GB/s here: docs/kernels.md).
int4: Int4Linear below.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ragserve_engine.compilation import cpu_ops
from ragserve_engine.layers.replace import replace_linears

QUANTIZATIONS = ("int8", "int4")
GROUP = 32  # int4 and grouped int8: input features per scale (llama.cpp's Q4_1 and Q8_0 groups)
BLOCK = 64  # output channels per block of the C++ kernel's layout (one cache line per input feature)


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear, blocked: bool | None = None, grouped: bool = False) -> None:
        """blocked: the C++ kernel's layout; None: when on CPU and the C++ ops load. grouped: a float16 scale
        per 32 input features of a channel (llama.cpp's Q8_0; int4's LM head), not one per channel; CPU
        with the C++ ops only (always blocked)."""
        super().__init__()
        w = linear.weight.detach().float()
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.out_features, self.in_features = w.shape
        self.grouped = grouped
        if grouped:
            if w.device.type != "cpu" or not cpu_ops.load():
                raise ValueError("int8 in groups of 32 runs on CPU with the C++ CPU ops (it needs a C++ compiler)")
            self.blocked = True
            qweight, scale = int8_per_group(w)
        else:
            self.blocked = w.device.type == "cpu" and cpu_ops.load() if blocked is None else blocked
            qweight, scale = int8_per_channel(w, self.blocked)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.grouped:
            y = torch.ops.ragserve.int8_group_linear(flat, self.qweight, self.scales, self.bias, self.out_features)
        elif self.blocked:
            y = torch.ops.ragserve.int8_linear(flat, self.qweight, self.scales, self.bias, self.out_features)
        else:
            y = torch.ops.aten._weight_int8pack_mm(flat.to(torch.bfloat16), self.qweight, self.scales).to(x.dtype)
            if self.bias is not None:
                y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The float32 [out, in] weight this layer multiplies by."""
        if self.grouped:
            w = self.qweight.float() * self.scales.float()[:, torch.arange(self.in_features) // GROUP]
            return unblock_weight(w)[: self.out_features]
        w = unblock_weight(self.qweight) if self.blocked else self.qweight
        return (w.float() * self.scales.float()[:, None])[: self.out_features]


def int8_per_channel(w: torch.Tensor, blocked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per output channel: blocked [n / 64, k, 64] with float32 scales padded
    to the block, or plain [n, k] with bfloat16 scales (torch's _weight_int8pack_mm)."""
    out = w.shape[0]
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    qweight = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    if blocked:
        return block_weight(qweight), F.pad(scale, (0, -out % BLOCK))
    return qweight, scale.to(torch.bfloat16)


def int8_per_group(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with a float16 scale per 32 input features of a channel (Q8_0): blocked
    [n / 64, k, 64] weight, scales [n / 64, groups, 64]."""
    groups = group_weight(w)
    scale = (groups.abs().amax(dim=2) / 127.0).clamp(min=1e-8).half()
    qweight = torch.round(groups / scale.float()[..., None]).clamp(-127, 127).to(torch.int8).flatten(1)
    return block_weight(qweight[:, : w.shape[1]]), block_weight(scale)


class Int4Linear(nn.Module):
    """--quantization int4: llama.cpp's Q4_1 scheme, w = d * q + m with q in 0..15, one float16 d and m per
    32 input features of an output channel (5 bits a weight). On a Q4_1 GGUF, whose tensors are dequantized
    at load, it gets back the file's own 4-bit values wherever a group used its whole range. CPU only,
    through ragserve::int4_linear (the C++ ops must build)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        if w.device.type != "cpu" or not cpu_ops.load():
            raise ValueError("--quantization int4 runs on CPU with the C++ CPU ops (it needs a C++ compiler)")
        self.out_features, self.in_features = w.shape
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        groups = group_weight(w)
        low, high = groups.amin(dim=2), groups.amax(dim=2)
        d = ((high - low) / 15).clamp(min=1e-8).half()
        m = low.half()
        q = torch.round((groups - m.float()[..., None]) / d.float()[..., None]).clamp(0, 15).to(torch.uint8)
        q = block_weight(q.flatten(1)[:, : self.in_features])  # [n/64, k, 64]
        self.register_buffer("qweight", q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4))
        self.register_buffer("scales", block_weight(d))  # [n/64, groups, 64]
        self.register_buffer("mins", block_weight(m))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        y = torch.ops.ragserve.int4_linear(flat, self.qweight, self.scales, self.mins, self.bias, self.out_features)
        return y.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The float32 [out, in] weight this layer multiplies by."""
        q = torch.cat([self.qweight & 15, self.qweight >> 4], dim=2).float()  # [n/64, k, 64]
        groups = torch.arange(self.in_features) // GROUP
        w = q * self.scales.float()[:, groups] + self.mins.float()[:, groups]
        return unblock_weight(w)[: self.out_features]


def group_weight(w: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [out padded to 64, ceil(in / 32), 32]: each channel's groups of 32 input features."""
    out, k = w.shape
    return F.pad(w, (0, -k % GROUP, 0, -out % BLOCK)).unflatten(1, (-1, GROUP))


def block_weight(qweight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [ceil(out / 64), in, 64]: at each input feature, 64 output channels side by side."""
    out, k = qweight.shape
    padded = F.pad(qweight, (0, 0, 0, -out % BLOCK))
    return padded.view(-1, BLOCK, k).transpose(1, 2).contiguous()


def unblock_weight(blocked: torch.Tensor) -> torch.Tensor:
    """block_weight's inverse, padding channels kept: [n / 64, in, 64] -> [n, in]."""
    return blocked.transpose(1, 2).reshape(-1, blocked.shape[1])


def quantize_weights(model: nn.Module, method: str) -> nn.Module:
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {method!r}")
    if method == "int4" and isinstance(getattr(model, "lm_head", None), nn.Linear):
        # as llama.cpp's 4-bit files keep the output in 8 bits (Q8_0: a scale per 32)
        model.lm_head = Int8Linear(model.lm_head, grouped=True)
    return replace_linears(model, Int8Linear if method == "int8" else Int4Linear)
