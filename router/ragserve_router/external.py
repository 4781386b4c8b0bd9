"""External (vLLM) engines: the `--external-engine` spec and the tasks that follow their KV events.

One `ZmqEventSubscriber` per data-parallel rank (vLLM publishes rank r on port + r) feeds a
`VllmIndexer`, whose ops go to the router state through `apply`, as a registered engine's gRPC events do,
so KVAware's `match_exact` sees the blocks of an external engine as those of a registered one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ragserve.external_engine import ExternalEngineSpec  # parsed there: router_args imports no router code
from ragserve.model_source import load_tokenizer as load_model_tokenizer
from ragserve.model_source import resolve_model
from ragserve.tokenizer import PromptTokenizer
from ragserve.vllm_events import Cold, Received, ZmqEventSubscriber
from ragserve_router.engines import EXTERNAL, EngineRecord, ModelSpec
from ragserve_router.state import KVOp, RouterState
from ragserve_router.vllm_index import BlockSizeMismatch, VllmIndexer

log = logging.getLogger(__name__)


async def apply_ops(state: RouterState, plan: dict[str, list[KVOp]], seq: int) -> None:
    for index_id, ops in plan.items():
        await state.apply(index_id, ops, seq)


@dataclass
class RankFollower:
    """Follows one rank's publisher into the state until cancelled, or refused (block size)."""

    indexer: VllmIndexer
    subscriber: ZmqEventSubscriber
    state: RouterState
    refused: str | None = None  # why this rank's events are not used
    colds: int = 0
    batches: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # set once the catch-up replay is done

    stale: bool = False  # an apply failed (state unreachable): the engine is cleared before the next batch
    applied: Callable[[list[KVOp]], None] = lambda ops: None  # ops in the state (the router's kv_events counter)

    async def run(self) -> None:
        await self._apply(self.indexer.cold(), 0)  # whatever the state held came from another process
        try:
            for item in await self.subscriber.catch_up():
                await self.handle(item)
            self.ready.set()
            async for item in self.subscriber:
                await self.handle(item)
        except BlockSizeMismatch as exc:
            self.refused = str(exc)
            log.error("external engine refused, routed on load (and routing history) only: %s", exc)
            await self._apply(self.indexer.cold(), 0)
        finally:
            self.ready.set()
            self.subscriber.close()

    async def handle(self, item: Received | Cold) -> None:
        if self.stale and not await self._apply(self.indexer.cold(), 0):
            return  # still unreachable: this batch is lost too, and the engine stays to be cleared
        if isinstance(item, Cold):
            self.colds += 1
            log.warning("external engine %s is cold (%s): %s", self.indexer.index_id, item.reason, item.detail)
            await self._apply(self.indexer.cold(), 0)
            return
        self.batches += 1
        await self._apply(self.indexer.events(item.batch.events), item.seq + 1)

    async def clear(self) -> bool:
        """Forget the engine's blocks (it is gone); False if the state could not be written."""
        return await self._apply(self.indexer.cold(), 0)

    async def _apply(self, plan: dict[str, list[KVOp]], seq: int) -> bool:
        """Apply ops; on a state failure the ops are lost, so the engine is marked stale (cleared later)."""
        try:
            await apply_ops(self.state, plan, seq)
            for ops in plan.values():
                self.applied(ops)
        except Exception as exc:
            if not self.stale:
                log.warning(
                    "external engine %s: router state unavailable, will clear it: %s", self.indexer.index_id, exc
                )
            self.stale = True
            return False
        self.stale = False
        return True


def followers(
    spec: ExternalEngineSpec,
    engine_id: str,
    model_id: str,
    block_size: int,
    state: RouterState,
    applied: Callable[[list[KVOp]], None] | None = None,
) -> list[RankFollower]:
    """One follower per data-parallel rank of an external engine (start each one's run() as a task)."""
    out = []
    for (_, events, replay), index_id in zip(spec.endpoints(), spec.index_ids(engine_id), strict=True):
        indexer = VllmIndexer(index_id, model_id, block_size)
        follower = RankFollower(indexer, ZmqEventSubscriber(events, replay), state)
        if applied is not None:
            follower.applied = applied
        out.append(follower)
    return out


def load_tokenizer(path: str) -> PromptTokenizer:
    """--tokenizer: a directory with tokenizer.json (a Hugging Face model directory) or a .gguf file."""
    if (Path(path) / "tokenizer.json").is_file():
        return PromptTokenizer.from_dir(path)
    try:
        return load_model_tokenizer(resolve_model(path))
    except (FileNotFoundError, ValueError) as exc:
        raise FileNotFoundError(f"--tokenizer {path}: not a directory with tokenizer.json or a .gguf file") from exc


class ExternalEngines:
    """This router's external engines (--external-engine, and pods found by --external-k8s-selector): their
    pool records, the spec the router hashes their prompts with, and the followers of their KV events (one
    task per data-parallel rank)."""

    def __init__(self, specs: list[ExternalEngineSpec], tokenizer: PromptTokenizer, block_size: int) -> None:
        fingerprint = tokenizer.fingerprint()
        # the key root: the router keys both the events and the prompts, so it only has to be the same for both
        self.spec = ModelSpec(f"external:{fingerprint}", block_size, fingerprint)
        self.tokenizer = tokenizer
        self.engines = {f"external-{i}": spec for i, spec in enumerate(specs)}
        self.followers: dict[str, list[RankFollower]] = {}
        self._tasks: dict[str, list[asyncio.Task]] = {}
        self._clearing: dict[str, asyncio.Task] = {}  # a removed engine's index being cleared
        self._lost: set[asyncio.Task] = set()  # an unreachable engine's index being cleared
        self._state: RouterState | None = None
        self._applied: Callable[[list[KVOp]], None] | None = None

    def record(self, engine_id: str) -> EngineRecord:
        """Its pool record (models and load come from its /v1/models and /metrics, as for static engines)."""
        s = self.spec
        return EngineRecord(
            engine_id, self.engines[engine_id].url, [], EXTERNAL, s.model_id, s.block_size, s.tokenizer_fingerprint
        )

    def records(self) -> list[EngineRecord]:
        return [self.record(e) for e in self.engines]

    def exact_index(self, engine_id: str) -> bool:
        """Its blocks are in the exact index under its own id: followed, one rank, not refused."""
        ranks = self.followers.get(engine_id)
        return bool(ranks) and len(ranks) == 1 and ranks[0].refused is None

    def offload_tiers(self, engine_id: str) -> list[tuple[str, str]]:
        """(state id, medium) of each non-GPU medium its events have put blocks in (exact-index engines)."""
        if not self.exact_index(engine_id):
            return []
        return self.followers[engine_id][0].indexer.offload_tiers()

    def lost(self, engine_id: str) -> asyncio.Task | None:
        """The engine stopped answering: forget its blocks (a process that died took its KV cache with it;
        a restarted one may publish nothing, or sequence numbers past the old ones, before it is routed to).
        The followers keep running and fill the index again from the engine's next events."""
        ranks = self.followers.get(engine_id, [])
        if not ranks:
            return None

        async def clear() -> None:
            for rank in ranks:
                await rank.clear()
            log.warning("external engine %s unreachable: its KV index is cleared", engine_id)

        task = asyncio.create_task(clear(), name=f"lost-{engine_id}")
        self._lost.add(task)
        task.add_done_callback(self._lost.discard)
        return task

    def start(self, state: RouterState, applied: Callable[[list[KVOp]], None] | None = None) -> None:
        """Follow every engine; applied(ops) after each batch of ops reaches the state."""
        self._state, self._applied = state, applied
        for engine_id in self.engines:
            self._follow(engine_id)

    def _follow(self, engine_id: str) -> None:
        assert self._state is not None
        spec = self.engines[engine_id]
        ranks = followers(spec, engine_id, self.spec.model_id, self.spec.block_size, self._state, self._applied)
        self.followers[engine_id] = ranks
        clearing = self._clearing.get(engine_id)
        self._tasks[engine_id] = [
            asyncio.create_task(_after(clearing, f), name=f"follow-{f.indexer.index_id}") for f in ranks
        ]
        log.info("following external engine %s (%s) on %s", engine_id, spec.url, spec.events)

    def add(self, engine_id: str, spec: ExternalEngineSpec) -> EngineRecord:
        """A new engine (a discovered pod), followed from now on if start() was called; its pool record."""
        if engine_id in self.engines:
            self.remove(engine_id)
        self.engines[engine_id] = spec
        if self._state is not None:
            self._follow(engine_id)
        return self.record(engine_id)

    def remove(self, engine_id: str) -> asyncio.Task | None:
        """Stop following the engine and clear its blocks from the index (a task; a re-add waits for it)."""
        self.engines.pop(engine_id, None)
        ranks = self.followers.pop(engine_id, [])
        tasks = self._tasks.pop(engine_id, [])
        for task in tasks:
            task.cancel()
        if not ranks:
            return None
        previous = self._clearing.get(engine_id)

        async def clear() -> None:
            if previous is not None:
                await asyncio.gather(previous, return_exceptions=True)
            await asyncio.gather(*tasks, return_exceptions=True)
            for rank in ranks:
                rank.subscriber.close()  # its run() closes it, unless cancelled before it started
                await rank.clear()
            log.info("external engine %s removed, its KV index cleared", engine_id)

        task = asyncio.create_task(clear(), name=f"clear-{engine_id}")
        self._clearing[engine_id] = task
        task.add_done_callback(lambda t: self._clearing.get(engine_id) is t and self._clearing.pop(engine_id))
        return task

    async def stop(self) -> None:
        tasks = [t for ts in self._tasks.values() for t in ts]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, *self._clearing.values(), *self._lost, return_exceptions=True)
        self._tasks.clear()


async def _after(previous: asyncio.Task | None, follower: RankFollower) -> None:
    """Run a follower once the previous follower of the same engine id has cleared its index."""
    if previous is not None:
        await asyncio.gather(previous, return_exceptions=True)
    await follower.run()
