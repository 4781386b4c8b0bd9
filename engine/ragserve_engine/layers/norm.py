import torch
from torch import nn

from ragserve_engine.layers import fused


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`, adds it first and returns (normed, new residual)."""
        if residual is None:
            return fused.call("rms_norm", x.shape[0], x, self.weight, self.eps)
        return fused.call("add_rms_norm", x.shape[0], x, residual, self.weight, self.eps)
