"""Swapping a model's nn.Linear layers for another kind (prepacked, weight-only quantized)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> nn.Module:
    """Replace every nn.Linear (lm_head included; a tied embedding keeps its own full-precision copy)."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, make(child))
    return model
