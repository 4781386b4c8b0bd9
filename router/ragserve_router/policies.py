"""Routing policies. Each orders the candidate engines best first; the proxy tries them in that order.

A policy is a RoutingPolicy subclass with one `route()` method. POLICY_CLASSES maps each name of
ragserve.router_args.POLICIES (the launch spec's choices: flag, policy header, CRD enum) to its class;
a Decider holds one instance of each over a shared Context and asks the one a request names.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from operator import attrgetter

from ragserve.router_args import POLICIES, RouterConfig
from ragserve_router.engines import EngineRecord
from ragserve_router.kv_aware import KVAware
from ragserve_router.prompt import prompt_bytes
from ragserve_router.routing_policy import (
    Context,
    Decision,
    RouteRequest,
    RoutingPolicy,
    indexed,
    no_offload,
    nothing_held,
    nothing_pending,
    nothing_routed,
    reported_queued,
    reported_queued_prompts,
)
from ragserve_router.state import RouterState
from ragserve_router.store_index import StoreIndex

_ENGINE_ID = attrgetter("engine_id")
__all__ = ["POLICY_CLASSES", "Decider", "Decision", "KVAware", "RouteRequest", "RoutingPolicy"]


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    async def route(self, req: RouteRequest, cands: list[EngineRecord]) -> Decision:
        start = next(self.ctx.turns) % len(cands)
        return Decision(cands[start:] + cands[:start], self.name, "rotation")


class LeastLoaded(RoutingPolicy):
    name = "least_loaded"

    async def route(self, req: RouteRequest, cands: list[EngineRecord]) -> Decision:
        return Decision(self.ctx.by_load(cands), self.name, "load")


class Session(RoutingPolicy):
    """Sticky by session header (or the body's `user`) on a consistent-hash ring."""

    name = "session"

    async def route(self, req: RouteRequest, cands: list[EngineRecord]) -> Decision:
        key = req.headers.get(self.cfg.session_header.lower()) or req.body.get("user")
        if not isinstance(key, str) or not key:
            return Decision(self.ctx.by_load(cands), self.name, "no_session_key")
        return Decision(self.ctx.ring("session:" + key, cands, bounded=False), self.name, "session_key")


class Prefix(RoutingPolicy):
    """Same leading blocks (or context header) to the same engine, on a bounded-load ring."""

    name = "prefix"

    async def route(self, req: RouteRequest, cands: list[EngineRecord]) -> Decision:
        explicit = req.headers.get(self.cfg.context_header.lower())
        if explicit:
            key: bytes | str = "context:" + explicit
            reason = "context_header"
        elif req.key.hashes:
            key = req.key.hashes[min(self.cfg.prefix_key_blocks, len(req.key.hashes)) - 1]
            reason = "leading_blocks"
        else:
            key = hashlib.sha256(prompt_bytes(req.body, req.chat)).digest()
            reason = "short_prompt"
        return Decision(self.ctx.ring(key, cands, bounded=True), self.name, reason)


def keyed_by_name(*classes: type[RoutingPolicy]) -> dict[str, type[RoutingPolicy]]:
    """{name: class} in the order of ragserve.router_args.POLICIES, which must name exactly these classes."""
    by_name = {cls.name: cls for cls in classes}
    if sorted(by_name) != sorted(POLICIES) or len(by_name) != len(classes):
        raise RuntimeError(f"policy classes {sorted(by_name)} do not match ragserve.router_args.POLICIES {POLICIES}")
    return {name: by_name[name] for name in POLICIES}


POLICY_CLASSES = keyed_by_name(RoundRobin, LeastLoaded, Session, Prefix, KVAware)


class Decider:
    """Where a request goes: every routing policy, instantiated once over one shared Context; decide() asks
    the one the request names."""

    def __init__(
        self,
        cfg: RouterConfig,
        state: RouterState,
        load: Callable[[EngineRecord], float],
        kv_usage: Callable[[EngineRecord], float],
        queued: Callable[[EngineRecord], int] = reported_queued,
        routed_blocks: Callable[[EngineRecord, Sequence[bytes]], int] = nothing_routed,
        queued_prompts: Callable[[EngineRecord], int] = reported_queued_prompts,
        exact_index: Callable[[EngineRecord], bool] = indexed,
        offload_tiers: Callable[[EngineRecord], list[tuple[str, str]]] = no_offload,
        held_blocks: Callable[[EngineRecord, Sequence[bytes]], int] = nothing_held,
        pending_blocks: Callable[[EngineRecord, int], int] = nothing_pending,
    ) -> None:
        self.store = StoreIndex(cfg)
        ctx = Context(
            cfg, state, load, kv_usage, self.store, queued, queued_prompts, routed_blocks, exact_index, offload_tiers,
            held_blocks, pending_blocks,
        )  # fmt: skip
        self.by_name = {name: cls(ctx) for name, cls in POLICY_CLASSES.items()}

    async def decide(self, policy: str, req: RouteRequest, candidates: list[EngineRecord]) -> Decision:
        return await self.by_name[policy].route(req, sorted(candidates, key=_ENGINE_ID))
