"""How long the router waits before trying the next engine: exponential backoff with jitter, so replicas (and
requests) that failed together do not retry together."""

from __future__ import annotations

import random

from ragserve.router_args import RouterConfig


def backoff(cfg: RouterConfig, attempt: int, rng: random.Random | None = None) -> float:
    """Seconds before retry `attempt` (1 = the first retry): --retry-backoff doubling per attempt, capped at
    --retry-backoff-max, of which the --retry-jitter share is drawn uniformly (1: anywhere from 0 to the cap)."""
    ceiling = min(cfg.retry_backoff * 2 ** (attempt - 1), cfg.retry_backoff_max)
    return ceiling * (1 - cfg.retry_jitter * (rng or random).random())
