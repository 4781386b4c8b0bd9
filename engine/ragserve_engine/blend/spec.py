"""What a request asks of blending: where its chunks are, how much of them to recompute; what it got."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DEFAULT_RECOMPUTE_FRACTION = 0.15


@dataclass
class Selection:
    """How a blended prefill picks the chunk tokens it recomputes (docs/blend.md, "Selection")."""

    sink_tokens: int = 4  # each chunk's first tokens, always recomputed (attention sinks at position 0)
    filter_layers: int = 8  # gradual filtering over this many layers from the check layer...
    filter_start: float = 3.0  # ...keeping this many times the final count at the first of them
    value_weight: float = 0.0  # value deviation's weight next to key deviation
    check_layer: int = 1  # layers before it compute every row; selection starts here


@dataclass
class BlendUsage:
    """Where a blended prefill's prompt tokens came from: each token is counted in exactly one field."""

    reused_tokens: int = 0  # chunk tokens kept from K/V that existed before the request (chunk store, cachestore)
    computed_chunk_tokens: int = 0  # chunk tokens kept from chunks first computed for this request
    recomputed_tokens: int = 0  # prompt tokens the blended forward computed (non-chunk + selected)

    def add(self, other: BlendUsage) -> None:
        self.reused_tokens += other.reused_tokens
        self.computed_chunk_tokens += other.computed_chunk_tokens
        self.recomputed_tokens += other.recomputed_tokens


@dataclass
class BlendSpec:
    spans: list[tuple[int, int]]  # [start, end) token ranges of the prompt that are chunks
    recompute_fraction: float | None = None  # None: the engine's default
    cache_salt: str | None = None  # the request's own salt: chunks are keyed under it
    usage: BlendUsage = field(default_factory=BlendUsage, init=False)  # set by the blended prefill

    def validate(self, num_prompt_tokens: int) -> None:
        """Raises ValueError naming what is wrong."""
        if self.recompute_fraction is not None and not 0.0 <= self.recompute_fraction <= 1.0:
            raise ValueError("blend recompute fraction must be in [0, 1]")
        end = 0
        for start, stop in self.spans:
            if not end <= start < stop <= num_prompt_tokens:
                raise ValueError(f"chunk span {(start, stop)} is empty, overlaps or lies outside the prompt")
            end = stop

    def num_recompute(self, num_chunk_tokens: int, default_fraction: float) -> int:
        fraction = default_fraction if self.recompute_fraction is None else self.recompute_fraction
        return min(num_chunk_tokens, math.ceil(fraction * num_chunk_tokens))


def prefix_cache_salt(cache_salt: str | None) -> str:
    """A blended prompt's blocks are approximate: they are cached apart from exactly computed ones."""
    return f"ragserve-blend:{cache_salt or ''}"


def bind(req, spec: BlendSpec) -> None:
    """Attach a validated spec to a new Request (make_request); raises ValueError naming the problem."""
    spec.validate(len(req.prompt_token_ids))
    if req.params.prompt_logprobs is not None:
        raise ValueError("prompt_logprobs cannot be combined with blended chunks")
    spec.cache_salt = req.cache_salt
    req.cache_salt = prefix_cache_salt(req.cache_salt)
    req.external_checked = True  # its prefix is never fetched: a blended prefill starts from nothing
    req.blend = spec
