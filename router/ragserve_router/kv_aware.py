"""kv_aware: the lowest predicted time to first token (cost_model) over what each engine holds, can fetch and has
queued."""

from __future__ import annotations

import logging

from ragserve.chunks import chunk_record_keys
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
from ragserve_router.hashring import rendezvous_score
from ragserve_router.prompt import RoutingKey
from ragserve_router.routing_policy import TEXT_CHUNK_TOKENS, Context, Decision, RouteRequest, RoutingPolicy

log = logging.getLogger(__name__)


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
