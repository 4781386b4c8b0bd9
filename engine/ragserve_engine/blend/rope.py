"""Position fix-up: keys rotated at one position re-rotated to another (RoPE rotations compose additively).

R(p + d) k = R(d) R(p) k for every frequency, whatever the frequency scaling (default, linear, llama3),
so a stored key moves from its canonical position to its real one by one rotation of `delta`.
"""

from __future__ import annotations

import torch

from ragserve_engine.layers.rotary import RotaryEmbedding, _rotate


def rerotate(keys: torch.Tensor, delta: int, rotary: RotaryEmbedding) -> torch.Tensor:
    """keys: [..., num_kv_heads, head_dim] rotated at positions p; returns them rotated at p + delta."""
    if delta == 0:
        return keys
    cos, sin = rotary.cos[abs(delta)], rotary.sin[abs(delta)]
    return _rotate(keys, cos, sin if delta > 0 else -sin)
