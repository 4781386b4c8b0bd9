"""In-process router state (one router replica, no Redis)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from ragserve_router.admin_view import ADMIN_SETS, AdminChange, AdminView
from ragserve_router.approx_index import ApproxIndex
from ragserve_router.engines import EngineRecord, Load, TokenizerBlob
from ragserve_router.state import CLEARED, REMOVED, STORED, KVOp, RouterState, leading


class MemoryState(RouterState):
    def __init__(self, approx_max_entries: int = 200_000, clock=time.monotonic) -> None:
        self._clock = clock
        self._engines: dict[str, EngineRecord] = {}
        self._deadlines: dict[str, float] = {}
        self._seqs: dict[str, int] = {}
        self._blocks: dict[str, set[bytes]] = {}
        self._tokenizers: dict[str, TokenizerBlob] = {}
        self.approx = ApproxIndex(approx_max_entries, clock)
        self._admin: dict[str, set[str]] = {name: set() for name in ADMIN_SETS}

    async def register(self, record: EngineRecord, tokenizer: TokenizerBlob, ttl_s: float) -> int:
        self._tokenizers.setdefault(record.tokenizer_fingerprint, tokenizer)
        self._engines[record.engine_id] = record
        self._deadlines[record.engine_id] = self._clock() + ttl_s
        self._blocks.setdefault(record.engine_id, set())
        return self._seqs.get(record.engine_id, 0)

    async def heartbeat(self, engine_id: str, load: Load, ttl_s: float) -> bool:
        record = self._engines.get(engine_id)
        if record is None:
            return False
        record.load = load
        self._deadlines[engine_id] = self._clock() + ttl_s
        return True

    async def drop(self, engine_id: str) -> bool:
        known = self._engines.pop(engine_id, None) is not None
        self._deadlines.pop(engine_id, None)
        self._seqs.pop(engine_id, None)
        self._blocks.pop(engine_id, None)
        self.approx.forget(engine_id)
        return known

    async def engines(self) -> list[EngineRecord]:
        now = self._clock()
        return [r for r in self._engines.values() if self._deadlines[r.engine_id] >= now]

    async def expired(self) -> list[str]:
        now = self._clock()
        return [e for e, deadline in self._deadlines.items() if deadline < now]

    async def is_registered(self, engine_id: str) -> bool:
        return engine_id in self._engines

    async def tokenizer(self, fingerprint: str) -> TokenizerBlob | None:
        return self._tokenizers.get(fingerprint)

    async def last_seq(self, engine_id: str) -> int:
        return self._seqs.get(engine_id, 0)

    async def apply(self, engine_id: str, ops: list[KVOp], new_seq: int) -> None:
        blocks = self._blocks.setdefault(engine_id, set())
        for op in ops:
            if op.kind == STORED:
                blocks.update(op.hashes)
            elif op.kind == REMOVED:
                blocks.difference_update(op.hashes)
                self.approx.forget_blocks(engine_id, op.hashes)
            elif op.kind == CLEARED:
                blocks.clear()
                self.approx.forget(engine_id)  # a route there before the clear no longer implies its blocks
        self._seqs[engine_id] = new_seq

    async def num_blocks(self, engine_id: str) -> int:
        return len(self._blocks.get(engine_id, ()))

    async def match_exact(self, engine_ids: Sequence[str], hashes: Sequence[bytes]) -> dict[str, int]:
        out = {}
        for engine_id in engine_ids:
            blocks = self._blocks.get(engine_id, set())
            out[engine_id] = leading(map(blocks.__contains__, hashes))  # no generator frame a block
        return out

    async def record_route(self, hashes: Sequence[bytes], engine_id: str) -> None:
        self.approx.record(hashes, engine_id)

    def record_route_now(self, hashes: Sequence[bytes], engine_id: str) -> bool:
        self.approx.record(hashes, engine_id)
        return True

    async def match_approx(self, ttl_by_engine: dict[str, float], hashes: Sequence[bytes]) -> dict[str, int]:
        return self.approx.match(ttl_by_engine, hashes)

    async def trim_approx(self) -> int:
        return 0  # the in-process index evicts as it records

    async def admin_view(self) -> AdminView:
        return AdminView(**{name: frozenset(urls) for name, urls in self._admin.items()})

    async def admin_change(self, change: AdminChange) -> None:
        for name, urls in change.discard.items():
            self._admin[name].difference_update(urls)
        for name, urls in change.add.items():
            self._admin[name].update(urls)
