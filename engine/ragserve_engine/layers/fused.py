"""Fused elementwise ops: RMSNorm (+ residual add), rotary, SiLU x mul.

Eager, each is several passes over the activations; torch.compile (inductor: C++ on CPU, Triton on CUDA)
fuses each into one. A compiled call costs a fixed ~20-40 us more than its eager ops, which decode steps of
a few dozen tokens do not win back, so the compiled versions run only on steps of at least MIN_TOKENS
tokens (prefill). Off with --enforce-eager. Compiled lazily, once per process, the first time a step is
large enough; the time it took is logged, and inductor's cache (compilation/compile_cache.py) makes later
starts reuse the kernels.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ragserve_engine.compilation.compile_cache import INDUCTOR_OPTIONS, use_compile_cache
from ragserve_engine.compilation.events import compiling

logger = logging.getLogger(__name__)
MIN_TOKENS = 128
_state = {"enabled": False}
_compiled: dict[str, Callable] = {}
compile_seconds: dict[str, float] = {}  # per op, first call (trace + codegen, or a cache hit)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    x = x + residual
    return rms_norm(x, weight, eps), x


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary on [T, heads, D] with cos/sin [T, 1, D / 2] (float32)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


_EAGER = {f.__name__: f for f in (rms_norm, add_rms_norm, rotate, silu_and_mul)}


def set_compile(enabled: bool) -> None:
    """--enforce-eager turns it off; the engine turns it on at start-up otherwise."""
    if enabled:
        use_compile_cache()
    _state["enabled"] = enabled


def compile_enabled() -> bool:
    return _state["enabled"]


def call(name: str, num_tokens: int, *args):
    """The op `name`, compiled when enabled and the step has at least MIN_TOKENS tokens."""
    if not _state["enabled"] or num_tokens < MIN_TOKENS:
        return _EAGER[name](*args)
    fn = _compiled.get(name)
    if fn is None:
        fn = _compiled[name] = torch.compile(_EAGER[name], dynamic=True, options=INDUCTOR_OPTIONS)
        t0 = time.perf_counter()
        try:
            with compiling():
                out = fn(*args)
        except Exception:  # e.g. no C++ compiler for inductor: stay eager, say why once
            logger.exception("torch.compile of %s failed; running eager (as with --enforce-eager)", name)
            _state["enabled"] = False
            return _EAGER[name](*args)
        compile_seconds[name] = time.perf_counter() - t0
        logger.info("compiled %s in %.1f s", name, compile_seconds[name])
        return out
    return fn(*args)
