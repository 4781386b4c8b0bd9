"""External (vLLM) engines: the `--external-engine` spec and the tasks that follow their KV events.

One `ZmqEventSubscriber` per data-parallel rank (vLLM publishes rank r on port + r) feeds a
`VllmIndexer`, whose ops go to the router state through `apply`, as a registered engine's gRPC events do,
so KVAware's `match_exact` sees the blocks of an external engine as those of a registered one.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from ragserve.vllm_events import Cold, Received, ZmqEventSubscriber, offset_endpoint_port
from ragserve_router.state import KVOp, RouterState
from ragserve_router.vllm_index import BlockSizeMismatch, VllmIndexer

log = logging.getLogger(__name__)
FORMAT = "URL,events=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,dp=N]"


@dataclass(frozen=True)
class ExternalEngineSpec:
    url: str
    events: str
    replay: str | None = None
    dp: int = 1

    @classmethod
    def parse(cls, text: str) -> ExternalEngineSpec:
        url, *options = [part.strip() for part in text.split(",")]
        if not url.startswith(("http://", "https://")) or "=" in url:
            raise ValueError(f"--external-engine {text!r}: must start with the engine's http(s) URL ({FORMAT})")
        values: dict[str, str] = {}
        for option in options:
            name, sep, value = option.partition("=")
            if not sep or not value:
                raise ValueError(f"--external-engine {text!r}: {option!r} is not NAME=VALUE ({FORMAT})")
            if name not in ("events", "replay", "dp"):
                raise ValueError(f"--external-engine {text!r}: unknown option {name!r} (events, replay, dp)")
            if name in values:
                raise ValueError(f"--external-engine {text!r}: {name} given twice")
            values[name] = value
        if "events" not in values:
            raise ValueError(f"--external-engine {text!r}: events=tcp://HOST:PORT is required ({FORMAT})")
        for name in ("events", "replay"):
            if name in values:
                _check_tcp(text, name, values[name])
        dp = values.get("dp", "1")
        if not dp.isdigit() or int(dp) < 1:
            raise ValueError(f"--external-engine {text!r}: dp must be a positive integer, got {dp!r}")
        return cls(url.rstrip("/"), values["events"], values.get("replay"), int(dp))

    def endpoints(self) -> list[tuple[int, str, str | None]]:
        """(rank, PUB endpoint, replay endpoint) per data-parallel rank, by vLLM's port + rank rule."""
        out = []
        for rank in range(self.dp):
            events = offset_endpoint_port(self.events, rank)
            assert events is not None
            out.append((rank, events, offset_endpoint_port(self.replay, rank)))
        return out

    def index_ids(self, engine_id: str) -> list[str]:
        """State engine ids of its ranks' GPU blocks: the engine id itself without data parallelism."""
        return [engine_id] if self.dp == 1 else [f"{engine_id}/dp{rank}" for rank in range(self.dp)]


def _check_tcp(text: str, name: str, endpoint: str) -> None:
    host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not endpoint.startswith("tcp://") or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--external-engine {text!r}: {name}={endpoint!r} must be tcp://HOST:PORT")


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
            log.error("external engine refused: %s", exc)
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

    async def _apply(self, plan: dict[str, list[KVOp]], seq: int) -> bool:
        """Apply ops; on a state failure the ops are lost, so the engine is marked stale (cleared later)."""
        try:
            await apply_ops(self.state, plan, seq)
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
    spec: ExternalEngineSpec, engine_id: str, model_id: str, block_size: int, state: RouterState
) -> list[RankFollower]:
    """One follower per data-parallel rank of an external engine (start each one's run() as a task)."""
    out = []
    for (_, events, replay), index_id in zip(spec.endpoints(), spec.index_ids(engine_id), strict=True):
        indexer = VllmIndexer(index_id, model_id, block_size)
        out.append(RankFollower(indexer, ZmqEventSubscriber(events, replay), state))
    return out
