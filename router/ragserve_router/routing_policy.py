"""What every routing policy shares: the request (RouteRequest), the answer (Decision), the engine state a policy
reads (Context, its functions defaulting to the engines' own reports) and the RoutingPolicy base class."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from ragserve.keys import cacheable_blocks
from ragserve.router_args import RouterConfig
from ragserve_router.cost_model import Prediction
from ragserve_router.engines import EngineRecord
from ragserve_router.hashring import bounded_order, ring_order
from ragserve_router.prompt import TEXT_CHUNK_BYTES, RoutingKey
from ragserve_router.state import RouterState
from ragserve_router.store_index import StoreIndex

TEXT_CHUNK_TOKENS = TEXT_CHUNK_BYTES // 4  # about, for prompts hashed as text chunks


@dataclass
class RouteRequest:
    model: str
    body: dict
    chat: bool
    headers: Mapping[str, str]
    key: RoutingKey


@dataclass
class Decision:
    order: list[EngineRecord]
    policy: str
    reason: str
    cached_blocks: dict[str, int] = field(default_factory=dict)
    predictions: dict[str, Prediction] = field(default_factory=dict)  # kv_aware's cost model, per engine

    def new_tokens(self, engine_id: str) -> tuple[int, int]:
        """Prompt tokens the engine computes and fetches for the request, as the cost model predicted ((0, 0) for an
        engine it did not predict): what the router's slot on it counts (pool.reserve)."""
        p = self.predictions.get(engine_id)
        return (p.computed_tokens, p.fetched_tokens) if p else (0, 0)

    def predicted_cached_tokens(self, engine_id: str, key: RoutingKey) -> int | None:
        """Prompt tokens the engine should report cached: local hits and fetched blocks (never the last token)."""
        if not key.exact or key.num_prompt_tokens is None:
            return None
        if engine_id in self.predictions:
            p = self.predictions[engine_id]
            return p.local_tokens + p.fetched_tokens
        bs = key.block_tokens
        return min(self.cached_blocks.get(engine_id, 0) * bs, cacheable_blocks(key.num_prompt_tokens, bs) * bs)


def reported_queued(r: EngineRecord) -> int:
    """Prefill tokens waiting on an engine, as its last heartbeat says."""
    return r.load.queued_prefill_tokens


def reported_queued_prompts(r: EngineRecord) -> int:
    """How many prompts those tokens belong to, as its last heartbeat says (at least one)."""
    return max(1, r.load.num_waiting)


def indexed(r: EngineRecord) -> bool:
    """Whether the exact KV index covers the engine (the pool also knows of refused external engines)."""
    return r.has_exact_index


def no_offload(r: EngineRecord) -> list[tuple[str, str]]:
    """No blocks offloaded off the engine's GPU that the index tracks (registered engines)."""
    return []


def nothing_routed(r: EngineRecord, hashes: Sequence[bytes]) -> int:
    """No blocks known to be on their way to the engine (a router that does not track what it sent)."""
    return 0


def nothing_held(r: EngineRecord, hashes: Sequence[bytes]) -> int:
    """No blocks known to be in use on the engine (a router that does not track what it sent)."""
    return 0


def nothing_pending(r: EngineRecord, block_tokens: int) -> int:
    """No blocks known to be on their way to the engine's KV cache (a router that does not track what it sent)."""
    return 0


@dataclass
class Context:
    """What the policies route on, and the orderings they share."""

    cfg: RouterConfig
    state: RouterState
    load: Callable[[EngineRecord], float]
    kv_usage: Callable[[EngineRecord], float]
    store: StoreIndex
    # prefill tokens waiting on an engine (its heartbeat, reconciled with what this replica sent it since)
    queued: Callable[[EngineRecord], int] = reported_queued
    # how many prompts those tokens belong to (they share steps under a per-step prefill cap)
    queued_prompts: Callable[[EngineRecord], int] = reported_queued_prompts
    # leading blocks of a prompt that requests this replica sent the engine will leave there (no KV event yet)
    routed_blocks: Callable[[EngineRecord, Sequence[bytes]], int] = nothing_routed
    # whether the exact KV index covers the engine (registered engines, followed external ones)
    exact_index: Callable[[EngineRecord], bool] = indexed
    # (state id, medium) of each tier an engine offloads blocks to (an external engine's CPU / disk blocks)
    offload_tiers: Callable[[EngineRecord], list[tuple[str, str]]] = no_offload
    # leading blocks of a prompt that requests this replica sent the engine, not ended yet, hold there (in use)
    held_blocks: Callable[[EngineRecord, Sequence[bytes]], int] = nothing_held
    # KV blocks that requests this replica sent the engine after its last heartbeat take (not in its free count)
    pending_blocks: Callable[[EngineRecord, int], int] = nothing_pending
    turns: itertools.count = field(default_factory=itertools.count)  # one rotation shared by every policy

    def by_load(self, cands: list[EngineRecord]) -> list[EngineRecord]:
        """Least loaded first; ties by KV usage, then rotating."""
        turn, n = next(self.turns), len(cands)
        ranked = sorted(range(n), key=lambda i: (self.load(cands[i]), self.kv_usage(cands[i]), (i - turn) % n))
        return [cands[i] for i in ranked]

    def ring(self, key: bytes | str, cands: list[EngineRecord], bounded: bool) -> list[EngineRecord]:
        by_id = {r.engine_id: r for r in cands}
        ids = list(by_id)
        if bounded:
            order = bounded_order(key, ids, lambda e: self.load(by_id[e]), self.cfg.bounded_load)
        else:
            order = ring_order(key, ids)
        return [by_id[e] for e in order]


class RoutingPolicy:
    """One way to order the candidate engines; `name` is its entry in ragserve.router_args.POLICIES."""

    name: ClassVar[str]

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg

    async def route(self, req: RouteRequest, cands: list[EngineRecord]) -> Decision:
        raise NotImplementedError
