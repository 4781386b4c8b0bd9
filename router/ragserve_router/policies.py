"""Routing policies. Each orders the candidate engines best first; the proxy tries them in that order.

A policy is a RoutingPolicy subclass with one `route()` method. POLICY_CLASSES maps each name of
ragserve.router_args.POLICIES (the launch spec's choices: flag, policy header, CRD enum) to its class;
a Decider holds one instance of each over a shared Context and asks the one a request names.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import ClassVar

from ragserve.chunks import chunk_record_keys
from ragserve.keys import cacheable_blocks
from ragserve.router_args import POLICIES, RouterConfig
from ragserve_router.cost_model import (
    FleetSpeeds,
    Prediction,
    Speed,
    kv_room,
    offload_speed,
    output_tokens,
    predict,
)
from ragserve_router.engines import EngineRecord
from ragserve_router.hashring import bounded_order, rendezvous_score, ring_order
from ragserve_router.prompt import TEXT_CHUNK_BYTES, RoutingKey, prompt_bytes
from ragserve_router.state import RouterState
from ragserve_router.store_index import StoreIndex

log = logging.getLogger(__name__)
_ENGINE_ID = attrgetter("engine_id")
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


class KVAware(RoutingPolicy):
    """Lowest predicted time to first token (cost_model): cached, fetchable and queued work per engine."""

    name = "kv_aware"

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.speeds = FleetSpeeds()  # the candidates' calibrated speeds, until a heartbeat changes their loads

    async def route(self, req: RouteRequest, cands: list[EngineRecord]) -> Decision:
        key = req.key
        cached, stored, offloaded = await self._blocks(key, cands)
        bs = key.block_tokens or TEXT_CHUNK_TOKENS
        prompt = key.num_prompt_tokens if key.num_prompt_tokens is not None else (len(key.hashes) + 1) * bs
        speeds = self.speeds.of(tuple(r.engine_id for r in cands), [r.load for r in cands], bs)
        out = output_tokens(req.body)
        # leading blocks a prompt we sent moments ago leaves (held: holds) there; none without a full block
        sent_blocks = bool(key.hashes) and not key.chunk_tokens
        n, weight = len(key.hashes), self.cfg.work_weight
        # equal costs (a new document on an idle fleet): ties follow the leading blocks, so one document's
        # burst stays together while different documents spread, the same way on every replica
        tie = key.hashes[min(self.cfg.prefix_key_blocks, n) - 1] if n else str(next(self.ctx.turns))

        def prediction(r: EngineRecord, speed: Speed, decoding: float) -> Prediction:
            local, stored_blocks = cached.get(r.engine_id, 0), stored.get(r.engine_id, 0)
            if sent_blocks:  # a prompt sent there moments ago: its blocks are there by our turn
                local = max(local, self.ctx.routed_blocks(r, key.hashes))
            blocks, medium = offloaded.get(r.engine_id, (0, ""))
            if blocks > stored_blocks:  # the engine loads them from its own CPU / disk tier instead
                stored_blocks, speed = blocks, offload_speed(speed, medium, bs)
            queued, prompts = self.ctx.queued(r), self.ctx.queued_prompts(r)
            return predict(prompt, bs, local, stored_blocks, queued, decoding, out, speed, weight, prompts)

        def rank(r: EngineRecord, cost: float, decoding: float) -> tuple[bool, float, float, int]:
            held = self.ctx.held_blocks(r, key.hashes) * bs if sent_blocks and key.exact else 0
            size = r.block_size or bs
            full = not kv_room(r.load, prompt + out, size, held, lambda: self.ctx.pending_blocks(r, size))
            return full, cost, decoding, rendezvous_score(tie, r.engine_id)

        predictions, ranks = {}, {}
        for r, speed in zip(cands, speeds, strict=True):
            decoding = self.ctx.load(r)  # requests active there now
            p = predictions[r.engine_id] = prediction(r, speed, decoding)
            ranks[r.engine_id] = rank(r, p.cost, decoding)
        order = sorted(cands, key=lambda r: ranks[r.engine_id])
        best = predictions[order[0].engine_id]
        reason = self._reason(best, predictions)
        if log.isEnabledFor(logging.DEBUG):  # the per-decision record: why each engine ranked where it did
            log.debug("kv_aware %s: %s", reason, "; ".join(self._explain(r, predictions, ranks) for r in order))
        return Decision(order, self.name, reason, cached, predictions)

    async def _blocks(self, key: RoutingKey, cands: list[EngineRecord]) -> tuple[dict, dict, dict]:
        """Per engine: the prompt's leading blocks it holds, can fetch from its cachestore, and has offloaded (with
        the medium); a chunk set's blocks (_chunk_blocks). Nothing to look up without a full block."""
        if not key.hashes:
            return {}, {}, {}
        if key.chunk_tokens:
            cached, stored = await self._chunk_blocks(key, cands)
            return cached, stored, {}
        cached, stored = await self._cached_blocks(key, cands), await self._stored_blocks(key, cands)
        return cached, stored, await self._offloaded_blocks(key, cands)

    def _explain(self, r: EngineRecord, predictions: dict[str, Prediction], ranks: dict[str, tuple]) -> str:
        p, (full, *_) = predictions[r.engine_id], ranks[r.engine_id]
        return (
            f"{r.engine_id} cost={p.cost:.3f} ttft={p.ttft_s:.3f} local={p.local_tokens} fetched={p.fetched_tokens} "
            f"computed={p.computed_tokens} queued={p.queued_tokens}/{self.ctx.queued_prompts(r)} "
            f"decoding={self.ctx.load(r):g} rate={r.load.prefill_tokens_per_s:.0f} full={full}"
        )

    @staticmethod
    def _reason(best: Prediction, predictions: dict[str, Prediction]) -> str:
        if best.local_tokens < max(p.local_tokens for p in predictions.values()):
            return "spread"  # an engine holding more of the prompt was predicted slower
        if best.local_tokens:
            return "prefix_hit"
        return "store_hit" if best.fetched_tokens else "cost"

    async def _cached_blocks(self, key: RoutingKey, cands: list[EngineRecord]) -> dict[str, int]:
        if not key.hashes:
            return {}
        try:
            return await self._lookup(key, cands)
        except Exception as exc:  # shared state unreachable: route on load alone rather than fail
            log.warning("KV index lookup failed, routing on load only: %s", exc)
            return {}

    async def _lookup(self, key: RoutingKey, cands: list[EngineRecord]) -> dict[str, int]:
        state, cfg = self.ctx.state, self.cfg
        indexed = {r.engine_id: self.ctx.exact_index(r) for r in cands}
        with_events = [e for e, yes in indexed.items() if yes] if key.exact else []
        exact = await state.match_exact(with_events, key.hashes) if with_events else {}
        ttl = {e: cfg.approx_pending_ttl if yes else cfg.approx_ttl for e, yes in indexed.items()}
        approx = await state.match_approx(ttl, key.hashes)
        return {r.engine_id: max(exact.get(r.engine_id, 0), approx.get(r.engine_id, 0)) for r in cands}

    async def _stored_blocks(self, key: RoutingKey, cands: list[EngineRecord]) -> dict[str, int]:
        """Leading blocks each engine could fetch from the cachestore it uses (one lookup per store)."""
        if not key.exact or not key.hashes:
            return {}
        stores = {(r.cachestore, r.layout_fingerprint) for r in cands if r.cachestore}
        found = {}
        for address, layout in stores:
            if layout:
                found[(address, layout)] = await self.ctx.store.leading(address, layout, key.hashes)
        return {r.engine_id: found.get((r.cachestore, r.layout_fingerprint), 0) for r in cands}

    async def _offloaded_blocks(self, key: RoutingKey, cands: list[EngineRecord]) -> dict[str, tuple[int, str]]:
        """Per engine with offload tiers: the most leading blocks one tier holds, and that tier's medium."""
        tiers = {r.engine_id: self.ctx.offload_tiers(r) for r in cands} if key.exact and key.hashes else {}
        ids = [tier for ts in tiers.values() for tier, _ in ts]
        if not ids:
            return {}
        try:
            found = await self.ctx.state.match_exact(ids, key.hashes)
        except Exception as exc:  # as for the GPU index: route without it rather than fail
            log.warning("KV index lookup of offloaded blocks failed: %s", exc)
            return {}
        return {e: max(((found.get(t, 0), m) for t, m in ts), default=(0, "")) for e, ts in tiers.items()}

    async def _chunk_blocks(self, key: RoutingKey, cands: list[EngineRecord]) -> tuple[dict, dict]:
        """A chunk set (docs/blend.md): per engine, the blocks' worth of its chunks it holds (KV events, else
        routing history), and of those it holds or can fetch from its cachestore. Any order counts."""
        held = dict.fromkeys((r.engine_id for r in cands), 0)
        reach = dict(held)
        for h, n in zip(key.hashes, key.chunk_tokens, strict=True):
            here = await self._cached_blocks(RoutingKey([h], key.block_tokens, n), cands)  # one chunk: exact
            stores = await self._chunk_in_stores(h, n, key.block_tokens, cands)
            for r in cands:
                held[r.engine_id] += n * bool(here.get(r.engine_id))
                reach[r.engine_id] += n * bool(here.get(r.engine_id) or stores.get(r.engine_id))
        bs = key.block_tokens
        return {e: t // bs for e, t in held.items()}, {e: t // bs for e, t in reach.items()}

    async def _chunk_in_stores(self, key: bytes, n: int, bs: int, cands: list[EngineRecord]) -> dict[str, bool]:
        records = chunk_record_keys(key, n, bs)
        found = {}
        for address, layout in {(r.cachestore, r.layout_fingerprint) for r in cands if r.cachestore}:
            if layout:
                found[(address, layout)] = await self.ctx.store.leading(address, layout, records) == len(records)
        return {r.engine_id: found.get((r.cachestore, r.layout_fingerprint), False) for r in cands}


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
