"""The scheduler's side of the cachestore connector: requests WAITING_FOR_REMOTE_KVS.

A waiting request whose prefix past its local hit may be in the cachestore starts a fetch once (and again if
blocks it held were evicted while it waited). A fetch answered within INLINE_FETCH_WAIT_S whose blocks fit lands
in the same step; otherwise the request waits here while the others keep stepping, and goes back to waiting when
its fetch is done or past its deadline (then it recomputes the rest) and the blocks have landed. A decode engine
(--role decode) fetches the prompt's tail block too and lands it at admission (kv_tail.py).
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING

from ragserve.engine_args import EngineConfig
from ragserve.keys import cacheable_blocks
from ragserve_engine.kv_cache_manager import KVCacheManager
from ragserve_engine.kv_tail import land_tail, prompt_tail
from ragserve_engine.sequence import Request

if TYPE_CHECKING:
    from ragserve_engine.kv_connector import CacheStoreConnector, PendingFetch

INLINE_FETCH_WAIT_S = 0.003  # a fetch answered this fast (usually a miss) is admitted in the same step
IMPORT_BLOCKS_PER_STEP = 32  # fetched blocks landed in the paged cache per step (~24 MB of SmolLM2 float32 KV)


class RemoteFetches:
    def __init__(self, config: EngineConfig, kv_manager: KVCacheManager, connector: CacheStoreConnector | None) -> None:
        self.config, self.kv_manager, self.connector = config, kv_manager, connector
        self.pending: dict[Request, PendingFetch] = {}  # WAITING_FOR_REMOTE_KVS
        self.tails: dict[Request, tuple[int, bytes]] = {}  # --role decode: fetched prompt tails

    def __len__(self) -> int:
        return len(self.pending)

    def __iter__(self):
        return iter(self.pending)

    def start(self, req: Request, num_local: int, running: bool) -> int | None:
        """Fetch blocks past the local hit: once per request, and again if blocks it held since were evicted
        while it waited for admission (a queued request's prefix is not pinned). Returns how many blocks were
        cached at once, or None when the request now waits here (`running`: other requests hold blocks)."""
        if self.connector is None or len(req.live_seqs) > 1:
            return 0
        if req.external_checked and num_local >= req.external_blocks:
            return 0
        req.external_checked, req.external_blocks = True, num_local
        if req.params.prompt_logprobs is not None:
            return 0
        seq = req.live_seqs[0]
        hashes = seq.block_hashes[: cacheable_blocks(seq.num_tokens, self.kv_manager.block_size)]
        tokens = seq.token_ids[: len(hashes) * self.kv_manager.block_size]
        tail = prompt_tail(self.kv_manager, seq, req.cache_salt) if self._fetches_tail(req) else None
        pending = self.connector.start_fetch(hashes, num_local, req.request_id, tokens, req.cache_salt, tail)
        if pending is None:
            return 0
        if (
            self.connector.wait(pending, INLINE_FETCH_WAIT_S)
            and self._room_for(pending, running)
            and self._small(pending)
        ):
            return self._finish(req, pending)
        self.pending[req] = pending
        return None

    def poll(self, running: bool) -> list[Request]:
        """Requests whose fetch is done (or past its deadline, with what arrived) and whose blocks have room and
        landed: IMPORT_BLOCKS_PER_STEP blocks per step over all of them, so a long prompt's KV is copied into the
        paged cache over a few steps, each a little longer, not in one long one."""
        now, budget, ready = time.monotonic(), IMPORT_BLOCKS_PER_STEP, []
        for req, pending in list(self.pending.items()):
            if budget <= 0 or not (pending.done() or pending.expired(now)) or not self._room_for(pending, running):
                continue
            landed = pending.landed
            done = self._finish(req, pending, budget)  # past its deadline: the prefix that arrived
            budget -= pending.landed - landed
            if done is not None:
                del self.pending[req]
                ready.append(req)
        return ready

    def wait(self, max_s: float) -> None:
        """Nothing else to run: sleep until a fetch completes or a deadline passes (at most max_s)."""
        if not self.pending:
            return
        first_deadline = min(p.deadline for p in self.pending.values())
        timeout = min(max_s, max(0.0, first_deadline - time.monotonic()))
        wait_futures([p.future for p in self.pending.values()], timeout=timeout, return_when=FIRST_COMPLETED)

    def tail(self, req: Request, num_hits: int) -> int:
        """Tokens of the fetched tail that land at admission: with every cacheable block hit, else none. All of the
        tail when the request carries the prefill engine's first token; otherwise all but the last prompt token,
        which the first step computes again for the logits."""
        if req not in self.tails:
            return 0
        seq = req.live_seqs[0]
        if len(req.live_seqs) > 1 or num_hits != cacheable_blocks(seq.num_tokens, self.kv_manager.block_size):
            del self.tails[req]
            return 0
        return min(self.tails[req][0], seq.num_tokens - 1 - num_hits * self.kv_manager.block_size)

    def land_tail(self, req: Request, num_hits: int, count: int) -> None:
        """At admission (slots allocated): the fetched tail KV fills the block after the hits."""
        land_tail(self.connector, req.live_seqs[0], num_hits, self.tails.pop(req)[1], count)

    def drop(self, req: Request) -> None:
        self.tails.pop(req, None)
        if req in self.pending:
            self.connector.abandon(self.pending.pop(req))

    def _room_for(self, pending: PendingFetch, running: bool) -> bool:
        """A settled fetch imports when its blocks fit; else it waits while running requests hold the blocks
        it needs (they free them as they finish): importing part of it would mean recomputing the rest."""
        if pending.to_land is not None:  # landing: the blocks left had room when it started
            return True
        return len(self.connector.settle(pending)) <= self.connector.room(pending) or not running

    def _small(self, pending: PendingFetch) -> bool:
        """Lands at once: within one step's import budget."""
        return len(self.connector.settle(pending)) <= IMPORT_BLOCKS_PER_STEP

    def _finish(self, req: Request, pending: PendingFetch, max_blocks: int | None = None) -> int | None:
        """Land the fetched blocks (at most max_blocks more); None while some are still to land."""
        num_fetched = self.connector.finish_fetch(pending, max_blocks)
        if num_fetched is None:
            return None
        req.external_blocks = pending.num_local + num_fetched
        if pending.tail_kv and req.external_blocks == len(pending.hashes):
            self.tails[req] = pending.tail_kv
        return num_fetched

    def _fetches_tail(self, req: Request) -> bool:
        """A decode engine fetches the prompt's tail block (kv_tail.py; prompt_tail: when the sequence's cacheable
        blocks end where it starts); no one else stores tails."""
        return self.config.role == "decode"
