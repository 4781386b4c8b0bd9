"""The engines this replica can route to: registered (shared state), static and discovered pods.

Also the local view of each engine's health: requests in flight from this replica (a slot is
reserved at decision time, so a burst sees its own earlier choices) and health, which only
connection errors, timeouts and failed /health probes take away; a request-scoped failure
never does (a client must not be able to poison an engine). Beside health, each engine's circuit
breaker (breaker.py) keeps an engine whose requests keep failing out of the candidates.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import httpx

from ragserve.prom_text import engine_load
from ragserve.router_args import RouterConfig
from ragserve_router import admin_view
from ragserve_router.admin_view import AdminView
from ragserve_router.breaker import STATE_VALUE, STATES, Breaker
from ragserve_router.engine_tls import engine_verify
from ragserve_router.engines import CONNECT, EXTERNAL, GRPC, SOURCES, STATIC, TIMEOUT, EngineRecord, Load, ModelSpec
from ragserve_router.external import ExternalEngines
from ragserve_router.health import judge
from ragserve_router.metrics import RouterMetrics
from ragserve_router.slots import Health, Slot, leading_match
from ragserve_router.state import RouterState

log = logging.getLogger(__name__)

# a heartbeat is taken on the engine, sent over gRPC and handled here: how old it can be on arrival, at most
# (an engine finishes a request, our client sees its last byte, then a report taken before that arrives)
REPORT_TRANSIT_S = 0.25


class EnginePool:
    def __init__(
        self, cfg: RouterConfig, state: RouterState, metrics: RouterMetrics, external: ExternalEngines | None = None
    ) -> None:
        self.cfg = cfg
        self.external = external
        self.state = state
        self.metrics = metrics
        self.registered: dict[str, EngineRecord] = {}
        self.discovered: dict[str, EngineRecord] = {}
        self.health: defaultdict[str, Health] = defaultdict(Health)
        self.served_models: set[str] = set()  # every model an engine has served: none now is a 503, not a 404
        self.breakers: dict[str, Breaker] = {}
        self.draining: set[str] = set()  # engines the admin API drains: no new requests (admin.py)
        headers = {"Authorization": f"Bearer {cfg.engine_api_key}"} if cfg.engine_api_key else {}
        self.probe_client = httpx.AsyncClient(timeout=httpx.Timeout(2.0), headers=headers, verify=engine_verify(cfg))
        for i, url in enumerate(cfg.static_engines):
            self.discovered[f"static-{i}"] = EngineRecord(f"static-{i}", url, [], source=STATIC)
            self.health[f"static-{i}"] = Health(healthy=False)  # until the first probe answers
        for record in external.records() if external else []:  # probed like static engines
            self.discovered[record.engine_id] = record
            self.health[record.engine_id] = Health(healthy=False)

    def all(self) -> list[EngineRecord]:
        if not self.discovered:
            return list(self.registered.values())
        urls = {r.url for r in self.registered.values()}
        return [*self.registered.values(), *(r for r in self.discovered.values() if r.url not in urls)]

    def get(self, engine_id: str) -> EngineRecord | None:
        return self.registered.get(engine_id) or self.discovered.get(engine_id)

    def healthy(self) -> list[EngineRecord]:
        return [r for r in self.all() if self.health[r.engine_id].healthy]

    def candidates(self, model: str) -> list[EngineRecord]:
        """Healthy engines serving the model, not draining, whose breaker lets a request through."""
        health, draining = self.health, self.draining
        return [
            r
            for r in self.all()
            if health[r.engine_id].healthy and model in r.models and r.engine_id not in draining
            and self.breaker(r.engine_id).allows()
        ]  # fmt: skip

    def breaker(self, engine_id: str) -> Breaker:
        breaker = self.breakers.get(engine_id)
        if breaker is None:
            cfg, gauge = self.cfg, self.metrics.breaker_state.labels(engine_id)
            transitions = self.metrics.breaker_transitions

            def changed(state: str) -> None:
                gauge.set(STATE_VALUE[state])
                transitions.labels(engine_id, state).inc()
                log.warning("engine %s: circuit breaker %s", engine_id, state.replace("_", "-"))

            breaker = self.breakers[engine_id] = Breaker(
                cfg.breaker_failures, cfg.breaker_cooldown, cfg.breaker_probes, on_change=changed
            )
            gauge.set(0)
            for state in STATES:
                transitions.labels(engine_id, state)
        return breaker

    def breaker_retry_after(self, model: str) -> float:
        """Seconds until an open breaker of a healthy engine serving the model lets a probe through (0: none)."""
        waits = [self.breaker(r.engine_id).retry_after() for r in self.healthy() if model in r.models]
        return min((w for w in waits if w > 0), default=0.0)

    def models(self) -> list[str]:
        models = {m for r in self.all() for m in r.models}
        self.served_models |= models
        return sorted(models)

    def reserve(
        self,
        engine: EngineRecord,
        prefill_tokens: int = 0,
        hashes: Sequence[bytes] = (),
        on_release: Callable[[], None] | None = None,
        output_tokens: int = 0,
        fetched_tokens: int = 0,
    ) -> Slot:
        """Count a request (the prompt tokens it makes the engine compute and fetch, the blocks it will leave
        there, the tokens it may generate) against the engine now, before any await, so the next decision sees
        it; on_release runs when it ends."""
        return Slot(self, engine, prefill_tokens, hashes, on_release, output_tokens, fetched_tokens)

    def prefilling(self, record: EngineRecord) -> int:
        """Prompt tokens of this replica's requests on the engine that have not produced a first token."""
        return sum(p.tokens for p in self.health[record.engine_id].prefills.values())

    def queued_prefill(self, record: EngineRecord) -> int:
        """Prefill tokens waiting on the engine: its heartbeat's queue less our prompts in it whose prefill has
        ended since (it is stale after, as for load), plus what we sent after that heartbeat; or, if more, what
        we sent that has no first token yet (a heartbeat taken mid-step predates both)."""
        health, reported_at = self.health[record.engine_id], record.load.reported_at
        prefills = health.prefills.values()
        since = sum(p.tokens for p in prefills if p.at > reported_at)
        ended = health.prefilled_since(reported_at, reported_at - REPORT_TRANSIT_S)
        reported = max(0, record.load.queued_prefill_tokens - ended)
        return max(reported + since, sum(p.tokens for p in prefills))

    def queued_prompts(self, record: EngineRecord) -> int:
        """Prompts the queued prefill tokens belong to: ours without a first token, or the heartbeat's waiting
        ones if more; at least 1."""
        return max(1, self.queue_depth(record))

    def queue_depth(self, record: EngineRecord) -> int:
        """Prompts waiting for their prefill on the engine: ours without a first token, or the heartbeat's
        waiting ones if more (the saturation check's queue, routing.Routing.saturated)."""
        return max(len(self.health[record.engine_id].prefills), record.load.num_waiting)

    def routed_blocks(self, record: EngineRecord, hashes: Sequence[bytes]) -> int:
        """Leading blocks of `hashes` that a prompt we sent the engine (no first token yet) will leave there."""
        return leading_match(hashes, (p.hashes for p in self.health[record.engine_id].prefills.values()))

    def held_blocks(self, record: EngineRecord, hashes: Sequence[bytes]) -> int:
        """Leading blocks of `hashes` that a request we sent the engine and that has not ended holds there: blocks
        in use, which the engine's free count leaves out and a request sharing them does not take anew."""
        return leading_match(hashes, (p.hashes for p in self.health[record.engine_id].prompts.values()))

    def pending_blocks(self, record: EngineRecord, block_tokens: int) -> int:
        """KV blocks our requests sent the engine after its last heartbeat will take: not in its free count yet."""
        return self.health[record.engine_id].blocks_sent_since(record.load.reported_at, block_tokens)

    def spec(self, model: str) -> ModelSpec | None:
        """How the router hashes the model's prompts: as its registered engines do, else as for external ones."""
        for record in self.registered.values():
            if model in record.models:
                return ModelSpec.of(record)
        if self.external and any(r.source == EXTERNAL and model in r.models for r in self.discovered.values()):
            return self.external.spec
        return None

    def exact_index(self, record: EngineRecord) -> bool:
        """The exact KV index covers the engine: registered, or external and followed (not refused)."""
        if record.source == EXTERNAL:
            return self.external is not None and self.external.exact_index(record.engine_id)
        return record.has_exact_index

    def offload_tiers(self, record: EngineRecord) -> list[tuple[str, str]]:
        """(state id, medium) of the CPU / disk tiers an external engine's events put blocks in."""
        if record.source != EXTERNAL or self.external is None:
            return []
        return self.external.offload_tiers(record.engine_id)

    def load(self, record: EngineRecord) -> float:
        """The engine's reported queue less our requests that finished since that report was taken (it is
        stale after), or our own in-flight count if higher. `reported_at` is when it arrived: it was taken up
        to REPORT_TRANSIT_S before, so a request released just before it arrived may still be counted in it."""
        health = self.health[record.engine_id]
        taken = record.load.reported_at - REPORT_TRANSIT_S
        reported = max(0, record.load.active - health.left_since(taken))
        return max(reported, health.inflight)

    def kv_usage(self, record: EngineRecord) -> float:
        return record.load.kv_usage

    def mark_failure(self, record: EngineRecord, kind: str) -> None:
        """Every engine failure counts against its breaker; connection errors and timeouts also take it out
        until a probe brings it back."""
        health = self.health[record.engine_id]
        self.breaker(record.engine_id).failure()
        self.metrics.engine_errors.labels(record.engine_id, kind).inc()
        if kind in (CONNECT, TIMEOUT):
            if health.healthy:
                log.warning("engine %s marked unhealthy after %s", record.engine_id, kind)
                self._unreachable(record, kind == CONNECT)
                self.metrics.health_transitions.labels(record.engine_id, "unhealthy").inc()
            health.healthy, health.streak = False, 0

    def _unreachable(self, record: EngineRecord, gone: bool) -> None:
        """A healthy engine stopped answering. An external engine that may have restarted (anything but a
        timeout, which a busy engine gives) loses its blocks from the index: its events may never say so."""
        if gone and record.source == EXTERNAL and self.external is not None:
            self.external.lost(record.engine_id)

    def mark_success(self, record: EngineRecord) -> None:
        self.breaker(record.engine_id).success()

    async def refresh(self) -> None:
        """Re-read registered engines and the admin API's changes from the shared state."""
        self.registered = {r.engine_id: r for r in await self.state.engines()}
        await self.apply_admin(await self.state.admin_view())
        self._forget_gone()
        for source in SOURCES:
            count = sum(1 for r in self.all() if r.source == source)
            self.metrics.engines_registered.labels(source).set(count)
        self.metrics.engines_healthy.set(len(self.healthy()))

    def _forget_gone(self) -> None:
        """Health and breakers of engines no longer in the pool (dropped, removed by the admin API): a request that
        ended after its engine left marks it again, recreating them."""
        known = self.registered.keys() | self.discovered.keys()  # a static engine a registered one hides stays
        for gone in [e for e in self.health if e not in known]:
            del self.health[gone]
        for gone in [e for e in self.breakers if e not in known]:
            del self.breakers[gone]

    async def apply_admin(self, view: AdminView) -> None:
        added = admin_view.sync(self.discovered, {r.url for r in self.registered.values()}, view)
        self.draining = {r.engine_id for r in self.all() if r.url in view.draining}
        for record in added:
            self.health[record.engine_id] = Health(healthy=False)  # until a probe answers
        await asyncio.gather(*(self.probe(r) for r in added))

    async def sweep(self) -> None:
        """Drop registered engines that missed 3 heartbeats; their blocks leave the index."""
        for engine_id in await self.state.expired():
            if await self.state.drop(engine_id):
                log.warning("engine %s missed its heartbeats: dropped", engine_id)
                self.metrics.engines_dropped.labels("heartbeat_timeout").inc()
            self.health.pop(engine_id, None)
            self.breakers.pop(engine_id, None)

    async def probe(self, record: EngineRecord) -> None:
        """Health (and, for engines that do not register, models and load) from the engine's HTTP API."""
        health = self.health[record.engine_id]
        try:
            if record.source == GRPC:
                (await self.probe_client.get(record.url + "/health")).raise_for_status()
            else:
                await self._probe_openai(record)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            if self._judge(record, health, False):
                log.warning("engine %s failed %d probes: %s", record.engine_id, -health.streak, type(exc).__name__)
                self._unreachable(record, not isinstance(exc, httpx.TimeoutException))
            return
        if self._judge(record, health, True):
            log.info("engine %s is healthy", record.engine_id)

    def _judge(self, record: EngineRecord, health: Health, passed: bool) -> bool:
        cfg = self.cfg
        changed = judge(health, passed, cfg.health_failure_threshold, cfg.health_success_threshold)
        if changed:
            self.metrics.health_transitions.labels(record.engine_id, "healthy" if passed else "unhealthy").inc()
        return changed

    async def _probe_openai(self, record: EngineRecord) -> None:
        resp = await self.probe_client.get(record.url + "/v1/models")
        resp.raise_for_status()
        ready = await self.probe_client.get(record.url + "/ready")  # a ragserve engine still loading or calibrating
        if ready.status_code == 503:  # answers 503; engines without /ready (404) count as ready once models list
            ready.raise_for_status()
        record.models = [m["id"] for m in resp.json()["data"]]
        resp = await self.probe_client.get(record.url + "/metrics")
        if resp.status_code == 200:
            load = engine_load(resp.text, required=False)
            record.load = Load(
                num_running=int(load.running),
                num_waiting=int(load.waiting),
                kv_usage=load.kv_usage,
                reported_at=time.time(),
            )

    async def probe_due(self) -> None:
        """Probe unhealthy engines, and every engine that does not heartbeat."""
        due = [r for r in self.all() if r.source != GRPC or not self.health[r.engine_id].healthy]
        await asyncio.gather(*(self.probe(r) for r in due))

    async def run(self) -> None:
        """Background upkeep: registry sync and heartbeat timeouts, probes."""
        sync_every = min(0.5, self.cfg.heartbeat_interval_ms / 2000)
        probes = asyncio.create_task(self._probe_loop())
        late = 0.0
        try:
            while True:
                try:
                    # a loop running behind by a heartbeat interval has heartbeats waiting to be read: an engine
                    # is not dropped for the router's own lateness
                    if late < self.cfg.heartbeat_interval_ms / 1000:
                        await self.sweep()
                    await self.refresh()
                    await self.state.trim_approx()
                except Exception as exc:  # shared state unreachable: keep the last view
                    log.warning("registry sync failed: %s", exc)
                slept = time.monotonic()
                await asyncio.sleep(sync_every)
                late = time.monotonic() - slept - sync_every
        finally:
            probes.cancel()

    async def _probe_loop(self) -> None:
        while True:
            await self.probe_due()
            await asyncio.sleep(self.cfg.probe_interval)

    async def close(self) -> None:
        await self.probe_client.aclose()
