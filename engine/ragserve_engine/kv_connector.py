"""CacheStoreConnector: the engine side of the shared KV-block store (best effort, never fatal).

Nothing here blocks the step loop on the network. Fetch: when a request is admitted, the full
prompt blocks past its local prefix hit are looked up and downloaded by a fetch thread while the
request waits in WAITING_FOR_REMOTE_KVS and the others keep stepping; the step thread then writes
the blocks into free paged-cache blocks under their hash (a memcpy, at most remote_fetches'
IMPORT_BLOCKS_PER_STEP a step, pinned until the request is admitted), so the request prefills only
the rest. Blocks arrive in chunks, in chain order; a fetch still running at its deadline is cut there:
the request keeps the prefix that arrived and recomputes the rest. Blocks that arrive while running
requests hold the pool wait (in host memory) until they have room. The deadline is at least the time
recomputing the blocks would take at the engine's measured prefill speed (waiting longer than that
cannot pay; waiting that long costs at most twice the better choice). The fetch and offload threads run at a
lower CPU priority than the step thread (BACKGROUND_NICE). Offload (kv_offload.py): after
each step, newly cached blocks are gathered (one copy) and handed to a background thread through a
bounded queue, which serializes and sends them (dropped under backpressure); so are the local prefix
hits of an admitted request that the store refused before. A block's bytes (gather,
scatter, size) are the KV cache's own (attention/kv_cache.py); this module decides what moves and when.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from ragserve import tracing
from ragserve_engine.attention.kv_cache import KVCacheTensors
from ragserve_engine.kv_cache_manager import KVCacheBlocks, KVCacheManager
from ragserve_engine.kv_offload import ConnectorStats, Offloader, back_cache, yield_to_steps

log = logging.getLogger("ragserve_engine.connector")
FETCH_DEADLINE_S = 1.0  # a request waits at least this long for the cachestore, then recomputes
FETCH_DEADLINE_MARGIN = 3.0  # ... or this many times the measured cost of its blocks, if longer
MAX_PENDING_FETCHES = 8  # more concurrent fetches than this: new requests recompute
FETCH_CHUNK_BLOCKS = 16  # blocks per Get: what arrived before a deadline is kept, and no call nears its timeout
FETCH_COST_DECAY = 0.8
LAND_MARGIN_BLOCKS = 16  # blocks backed past a fetch's own: those the requests decoding meanwhile take first


@dataclass
class PendingFetch:
    """A download in flight for one request: blocks hashes[num_local:] (a prefix of them, if stored)."""

    hashes: list[bytes]
    num_local: int
    future: Future
    deadline: float
    request_id: str = ""
    started: float = 0.0  # monotonic
    arrived: list = field(default_factory=list)  # blocks downloaded so far, in chain order (fetch thread appends)
    stop: threading.Event = field(default_factory=threading.Event)  # the step thread is done waiting
    blocks: list | None = None  # what the fetch delivered, once settled
    seconds: float = 0.0  # how long the download took, once settled
    token_ids: list[int] = field(default_factory=list)  # the request's tokens over `hashes` (for KV events)
    cache_salt: str | None = None
    tail: tuple[int, bytes] | None = None  # (tokens, key) of the prompt's tail block to fetch too (kv_tail.py)
    tail_arrived: list = field(default_factory=list)  # the tail block, once downloaded after the whole chain
    tail_kv: tuple[int, bytes] | None = None  # (tokens, KV bytes) of the tail, once settled with the whole chain
    to_land: int | None = None  # settled blocks that had room to land (set at the first finish_fetch)
    landed: int = 0  # of them, written into the paged cache so far (finish_fetch lands them over steps)
    held: KVCacheBlocks | None = None  # the pin on the landed prefix until the request is admitted
    land_s: float = 0.0  # seconds spent writing them
    closed: bool = False  # every block that will land has landed

    @property
    def to_come(self) -> int:
        """Blocks it may still land (open fetches: the next fetch's blocks land after them)."""
        if self.closed or self.stop.is_set():
            return 0
        return (len(self.hashes) - self.num_local if self.to_land is None else self.to_land) - self.landed

    def done(self) -> bool:
        return self.future.done()

    def expired(self, now: float) -> bool:
        return now >= self.deadline


class CacheStoreConnector:
    def __init__(
        self,
        client,
        kv_cache: KVCacheTensors,
        kv_manager: KVCacheManager,
        queue_blocks: int = 512,
        fetch_deadline_s: float = FETCH_DEADLINE_S,
        prefill_tokens_per_s: Callable[[], float] = lambda: 0.0,
        transfer_cpus: tuple[int, ...] = (),
    ) -> None:
        """`prefill_tokens_per_s`: the engine's measured prefill speed (0 until measured), for fetch deadlines;
        `transfer_cpus`: the fetch and offload threads' CPUs (--kv-transfer-cpus; default: the engine's)."""
        self.client = client
        self.fetch_deadline_s = fetch_deadline_s
        self.kv_cache, self.kv_manager = kv_cache, kv_manager
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.stats = ConnectorStats()
        self.offloader = Offloader(client, kv_cache, self.stats, queue_blocks, transfer_cpus)
        kv_manager.on_hits = self.offloader.offload_refused  # a refused block a prompt hits locally goes out again
        self.offload, self.flush, self.save_mark = (
            self.offloader.offload,
            self.offloader.flush,
            self.offloader.save_mark,
        )
        self.saved, self.stored, self.wait_saved = (
            self.offloader.saved,
            self.offloader.stored,
            self.offloader.wait_saved,
        )
        self._fetch_pool = ThreadPoolExecutor(
            2, thread_name_prefix="kv-fetch", initializer=yield_to_steps, initargs=(transfer_cpus,)
        )
        self._fetching: set[Future] = set()
        self._open: list[PendingFetch] = []  # fetches whose blocks have not all landed

    @classmethod
    def from_config(
        cls,
        config,
        layout: str,
        kv_cache: KVCacheTensors,
        kv_manager: KVCacheManager,
        prefill_tokens_per_s: Callable[[], float] = lambda: 0.0,
    ) -> CacheStoreConnector:
        from ragserve.token_auth import read_token
        from ragserve_cachestore.client import CacheStoreClient, TLSConfig

        tls = None
        if config.cachestore_tls_ca or config.cachestore_tls_cert:
            tls = TLSConfig(config.cachestore_tls_ca, config.cachestore_tls_cert, config.cachestore_tls_key)
        token = read_token(config.cachestore_token_file) if config.cachestore_token_file else None
        client = CacheStoreClient(config.cachestore, layout, timeout_s=2.0, tls=tls, token=token)
        cpus = config.kv_transfer_cpus or ()
        connector = cls(client, kv_cache, kv_manager, prefill_tokens_per_s=prefill_tokens_per_s, transfer_cpus=cpus)
        if config.role == "decode":
            threading.Thread(target=back_cache, args=(kv_cache, cpus), name="kv-back", daemon=True).start()
        return connector

    # ---- fetch ------------------------------------------------------------------------------------
    def start_fetch(
        self,
        hashes: list[bytes],
        num_local_hits: int,
        request_id: str = "",
        token_ids: list[int] = (),
        cache_salt: str | None = None,
        tail: tuple[int, bytes] | None = None,
    ) -> PendingFetch | None:
        """Download blocks hashes[num_local_hits:] in the background; None when there is nothing to ask.
        `token_ids`/`cache_salt`: the request's, which the imported blocks' KV events carry. `tail`: (tokens, key)
        of the prompt's tail block, fetched after the whole chain (disaggregated decode: kv_tail.py)."""
        missing = hashes[num_local_hits:]
        self._fetching = {f for f in self._fetching if not f.done()}
        if (not missing and tail is None) or len(self._fetching) >= MAX_PENDING_FETCHES:
            return None
        self.stats.queries += len(missing) * self.kv_manager.block_size
        arrived, stop, tail_arrived = [], threading.Event(), []
        span, tail_key = tracing.live.get(request_id), tail[1] if tail else None
        self._open = [p for p in self._open if p.to_come]
        ahead = sum(p.to_come for p in self._open)  # where it will land: after the open fetches' blocks
        land_ids = self.kv_manager.next_free_block_ids(ahead + len(missing) + LAND_MARGIN_BLOCKS)[ahead:]
        args = (missing, arrived, stop, span, tail_key, tail_arrived, land_ids)
        future = self._fetch_pool.submit(self._download, *args)
        self._fetching.add(future)
        now = time.monotonic()
        deadline = now + self.deadline_s(len(missing))
        pending = PendingFetch(
            hashes, num_local_hits, future, deadline, request_id, now, arrived, stop,
            token_ids=list(token_ids), cache_salt=cache_salt, tail=tail, tail_arrived=tail_arrived,
        )  # fmt: skip
        self._open.append(pending)
        return pending

    def deadline_s(self, num_blocks: int) -> float:
        """How long a fetch of num_blocks may take: the floor, a margin over the measured fetch cost, or the
        time recomputing them would take, whichever is longest (a RAG document: 100+ blocks, ~0.7 MB each for
        a small model in float32, takes seconds to fetch on a busy host, and recomputing it longer still)."""
        speed = self.prefill_tokens_per_s()
        recompute = num_blocks * self.kv_manager.block_size / speed if speed > 0 else 0.0
        measured = FETCH_DEADLINE_MARGIN * num_blocks * self.stats.fetch_s_per_block
        return max(self.fetch_deadline_s, measured, recompute)

    def wait(self, pending: PendingFetch, timeout: float) -> bool:
        try:
            pending.future.exception(timeout=max(0.0, timeout))
        except TimeoutError:
            return False
        return True

    def _download(
        self, missing: list[bytes], arrived: list, stop: threading.Event, span=None, tail_key=None, tail_arrived=None,
        land_ids: list[int] = (),
    ) -> tuple[list, float]:  # fmt: skip
        """(blocks of the stored prefix of `missing`, seconds it took); on the fetch thread. Chunk by chunk
        into `arrived`, until the prefix ends or the step thread stops waiting (`stop`); then the tail block
        (`tail_key`) into `tail_arrived` when the whole chain arrived. First the KV blocks the stored ones will
        land in (`land_ids`, the free queue's head when the fetch started) are backed (KVCacheTensors.back)."""
        t0 = time.perf_counter()
        try:
            with tracing.use(span):  # the cachestore calls carry the request's traceparent
                n = self.client.lookup(missing)
                self.kv_cache.back(list(land_ids[: n + LAND_MARGIN_BLOCKS]) if n else [])
                for i in range(0, n, FETCH_CHUNK_BLOCKS):
                    if stop.is_set():
                        break
                    chunk = missing[i : min(n, i + FETCH_CHUNK_BLOCKS)]
                    got = self.client.get(chunk)
                    arrived.extend(got)
                    if len(got) < len(chunk):
                        break
                if tail_key is not None and len(arrived) == len(missing) and not stop.is_set():
                    tail_arrived.extend(self.client.get([tail_key]))
        except Exception:  # a broken store costs a miss, never a request
            log.exception("cachestore fetch failed")
        return list(arrived), time.perf_counter() - t0

    def settle(self, pending: PendingFetch) -> list:
        """The fetched blocks, once the download is done or its deadline passed (a fetch cut there keeps the
        prefix that arrived); the same list on every call, so a request may wait for room to import it."""
        if pending.blocks is None:
            if pending.done():
                blocks, pending.seconds = pending.future.result()
            else:
                blocks, pending.seconds = list(pending.arrived), time.monotonic() - pending.started
                self.abandon(pending)
            # a chain: a block that does not fit ends it (those after it would land under the wrong hashes)
            pending.blocks = list(itertools.takewhile(self._fits, blocks))
            whole = len(pending.blocks) == len(pending.hashes) - pending.num_local
            if pending.tail and whole and pending.tail_arrived and self._fits(pending.tail_arrived[0]):
                pending.tail_kv = (pending.tail[0], pending.tail_arrived[0].data)
            self._count_fetch(pending)
        return pending.blocks

    def _count_fetch(self, pending: PendingFetch) -> None:
        nbytes = sum(len(b.data) for b in pending.blocks) + (len(pending.tail_kv[1]) if pending.tail_kv else 0)
        if nbytes:
            self.stats.count_transfer("fetched", nbytes, pending.seconds, requests=1)

    def room(self, pending: PendingFetch) -> int:
        """Free KV blocks the fetched blocks may land in, keeping the local prefix they extend."""
        return self.kv_manager.num_importable_blocks(pending.hashes[: pending.num_local])

    def finish_fetch(self, pending: PendingFetch, max_blocks: int | None = None) -> int | None:
        """On the step thread: cache the settled blocks that have a free KV block to land in (the request
        recomputes the rest), at most `max_blocks` more per call (remote_fetches.IMPORT_BLOCKS_PER_STEP: a
        2k-token float32 prompt is ~100 MB to copy, which lands over a few steps instead of stretching one).
        Returns how many were added in all once the last landed, None while some are still to land (the landed
        ones stay pinned until then)."""
        blocks = self.settle(pending)
        if pending.to_land is None:
            pending.to_land = min(len(blocks), self.room(pending))
            self.stats.not_imported += len(blocks) - pending.to_land
        start = pending.num_local + pending.landed
        n = min(pending.to_land - pending.landed, self.kv_manager.num_importable_blocks(pending.hashes[:start]))
        n = n if max_blocks is None else min(n, max_blocks)
        if n > 0:
            self._land(pending, blocks[pending.landed : pending.landed + n])
        if pending.landed < pending.to_land and n > 0:
            return None
        self.stats.not_imported += pending.to_land - pending.landed  # room taken since: the request computes them
        self.release(pending)
        pending.closed = True
        if pending.landed:
            self._finish_landing(pending)
        return pending.landed

    def _land(self, pending: PendingFetch, blocks: list) -> None:
        """Write `blocks` (the next ones of the chain) into free KV blocks, cached under their hashes, and pin
        the landed prefix so nothing evicts it before the request is admitted."""
        t0 = time.perf_counter()
        hashes, start = pending.hashes, pending.num_local + pending.landed
        fetched = hashes[start : start + len(blocks)]
        parent = hashes[start - 1] if start else None
        pinned = self.kv_manager.pin(hashes[:start])  # the import must not evict the prefix it extends
        try:
            bs = self.kv_manager.block_size
            tokens = pending.token_ids[start * bs : (start + len(fetched)) * bs]
            self.kv_manager.import_blocks(
                fetched, parent, lambda i, b: self.kv_cache.write_block(b, blocks[i].data), tokens, pending.cache_salt
            )
        finally:
            self.kv_manager.unpin(pinned)
        self.release(pending)
        pending.landed += len(blocks)
        pending.held = self.kv_manager.pin(hashes[: start + len(blocks)])
        pending.land_s += time.perf_counter() - t0
        for h in fetched:
            self.offloader.remember(h)

    def _finish_landing(self, pending: PendingFetch) -> None:
        self.stats.hits += pending.landed * self.kv_manager.block_size
        if span := tracing.live.get(pending.request_id):
            span.set_attribute(tracing.FETCHED_TOKENS, pending.landed * self.kv_manager.block_size)
        self._observe_cost((pending.seconds + pending.land_s) / pending.landed)

    def release(self, pending: PendingFetch) -> None:
        """Unpin the blocks landed so far (they stay cached: the request's admission hits them)."""
        if pending.held is not None:
            self.kv_manager.unpin(pending.held)
            pending.held = None

    def _observe_cost(self, cost: float) -> None:
        old = self.stats.fetch_s_per_block
        self.stats.fetch_s_per_block = cost if old == 0 else FETCH_COST_DECAY * old + (1 - FETCH_COST_DECAY) * cost

    def abandon(self, pending: PendingFetch) -> None:
        """The request stopped waiting (deadline, abort): the download stops, what it brings later is dropped.
        Past its deadline with nothing arrived, the fetch cost at least that long per block: the estimate (the
        router's fetch cost, the next deadline) learns it, instead of being measured only on fetches fast
        enough to finish (with blocks arrived, finish_fetch measures those). Once per fetch: one cut at its
        deadline that then waits for room may be aborted too."""
        self.release(pending)
        if pending.stop.is_set():
            return
        now = time.monotonic()
        pending.stop.set()
        num_blocks = len(pending.hashes) - pending.num_local
        if pending.expired(now) and not pending.arrived and num_blocks > 0:
            self._observe_cost((now - pending.started) / num_blocks)
        self.stats.abandoned += 1
        pending.future.cancel()

    def _fits(self, block) -> bool:
        return len(block.data) == self.kv_cache.block_nbytes

    def close(self) -> None:
        self.offloader.close()
        self._fetch_pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()
