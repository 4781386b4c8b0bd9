"""Offload: the engine's newly cached KV blocks to the cachestore, off the step loop (kv_connector.py's other half).

After each step the newly cached blocks are gathered (one copy) and handed to a background thread through a bounded
queue, which serializes and puts them (dropped under backpressure). Blocks stored or fetched recently are not sent
again; blocks whose last put the store did not take (down, backing off, queue full) are, when computed again or hit
in the local prefix cache by an admitted request (KVCacheManager.on_hits). A block is in the queue at most once: one
queued and not yet sent is not queued again. A prefill engine (kv_tail.py) waits on a save mark: the queue's end when
its prompt completed.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from ragserve import tracing
from ragserve_engine.attention.kv_cache import KVCacheTensors
from ragserve_engine.block_pool import KVCacheBlock

log = logging.getLogger("ragserve_engine.connector")
SEEN_LIMIT = 1 << 16
DIRECTIONS = ("stored", "fetched")
BACKGROUND_NICE = 10  # the fetch and offload threads' nice over the step thread's (CFS weight 110 against 1024)


def touch(recent: OrderedDict[bytes, None], h: bytes) -> None:
    """Add (or refresh) h in a bounded recency set (written by both the step and the offload
    thread: no KeyError if the other removed h meanwhile)."""
    recent.pop(h, None)
    recent[h] = None
    if len(recent) > SEEN_LIMIT:
        recent.popitem(last=False)


def yield_to_steps(cpus: tuple[int, ...] = ()) -> None:
    """Lower the calling thread's CPU priority (Linux nice is per thread): a transfer's (de)serialization and copies
    (~0.25 s of CPU for a 2k-token float32 prompt) then run when the step thread leaves the core instead of
    stretching the steps of the requests decoding on it. Where not allowed, nothing changes. `cpus`
    (--kv-transfer-cpus): move the thread onto those CPUs, off the step thread's core altogether."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE))
    except (AttributeError, OSError):
        pass
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)  # Linux: 0 is the calling thread, not the process
        except (AttributeError, OSError) as exc:
            log.warning("KV transfer thread stays on the engine's CPUs: cannot move it to %s: %s", cpus, exc)


def back_cache(kv_cache: KVCacheTensors, cpus: tuple[int, ...] = ()) -> None:
    """A decode engine (--role decode) lands every prompt's KV in fresh blocks: its whole cache is backed at start,
    at background priority, so a fetch does not back its blocks on the request path (~1.7 ms per 0.7 MB block on a
    VM, seconds for a 2k-token prompt when the step thread keeps the core busy)."""
    yield_to_steps(cpus)
    t0 = time.perf_counter()
    kv_cache.back_all()
    log.info("KV cache backed in %.1f s (--role decode)", time.perf_counter() - t0)


@dataclass
class ConnectorStats:
    queries: int = 0  # tokens looked up in the cachestore
    hits: int = 0  # tokens fetched from it
    offloaded: int = 0  # blocks the store newly stored (offload puts it took, less blocks it already held)
    dropped: int = 0  # blocks dropped under backpressure (never offloaded)
    not_imported: int = 0  # fetched blocks left out: no free KV block for them (the request recomputes those)
    abandoned: int = 0  # fetches cut at their deadline (the request recomputed the rest) or aborted
    fetch_s_per_block: float = 0.0  # recent cost of a fetched block (lookup + get + write), 0 until measured
    # KV moved, by direction ("stored": put to the store and accepted by it, "fetched": downloaded from it): block
    # bytes, seconds in the calls (stored: those the store answered), and requests (fetched: a request's download
    # that brought blocks; stored: a prompt a prefill engine stored for a decode engine, the store took every block
    # of it, kv_tail.py). Puts a down store dropped (the client logs them and backs off) count nowhere.
    transfer_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    transfer_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0.0))
    transfer_requests: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))

    def count_transfer(self, direction: str, nbytes: int, seconds: float, requests: int = 0) -> None:
        self.transfer_bytes[direction] += nbytes
        self.transfer_seconds[direction] += seconds
        self.transfer_requests[direction] += requests


class Offloader:
    def __init__(
        self, client, kv_cache: KVCacheTensors, stats: ConnectorStats, queue_blocks: int = 512, cpus: tuple = ()
    ) -> None:
        self.client, self.kv_cache, self.stats, self.cpus = client, kv_cache, stats, cpus
        self._seen: OrderedDict[bytes, None] = OrderedDict()  # stored or fetched recently: skip offload
        self._refused: OrderedDict[bytes, None] = OrderedDict()  # blocks whose last put the store did not take
        self._pending: set[bytes] = set()  # queued, not yet sent (added by the step thread, removed by the offload one)
        self._queue: queue.Queue = queue.Queue(maxsize=queue_blocks)
        self._queued = 0  # blocks ever queued for offload (step thread)
        self._sent = 0  # of them, put to the store or given up on, in queue order (offload thread)
        self._sent_cv = threading.Condition()
        self._thread = threading.Thread(target=self._offload_loop, name="kv-offload", daemon=True)
        self._thread.start()

    def offload(self, blocks: list[tuple[KVCacheBlock, bytes]], scheduled: list = ()) -> None:
        """Queue cached (block, hash) pairs (newly cached, or hits the store refused): one gather copy here, serialized
        and sent by the thread. The put is traced under the first traced request of the step (`scheduled`)."""
        todo = self._to_queue(blocks)
        if not todo:
            return
        room = max(self._queue.maxsize - self._queue.qsize(), 0)
        if room < len(todo):
            self.stats.dropped += len(todo) - room
            for _, h in todo[room:]:
                touch(self._refused, h)
            todo = todo[:room]
        if not todo:
            return
        gathered = self.kv_cache.gather([b.block_id for b, _ in todo])
        span = next((tracing.live[r] for r in (s.request.request_id for s in scheduled) if r in tracing.live), None)
        for i, (_, h) in enumerate(todo):
            self._pending.add(h)  # before the put: the thread may send it at once
            try:
                self._queue.put_nowait((h, gathered, i, span))
                self._queued += 1
                self.remember(h)
            except queue.Full:
                self._pending.discard(h)
                self.stats.dropped += 1
                touch(self._refused, h)

    def _to_queue(self, blocks: list[tuple[KVCacheBlock, bytes]]) -> list[tuple[KVCacheBlock, bytes]]:
        """The (block, hash) pairs to queue, each hash once: not stored or fetched recently, or refused the last
        time, and not in the queue already."""
        todo = {h: b for b, h in blocks if h not in self._pending and (h not in self._seen or h in self._refused)}
        return [(b, h) for h, b in todo.items()]

    def offload_refused(self, hits: list[KVCacheBlock]) -> None:
        """An admitted request's local prefix hits (KVCacheManager.on_hits): those whose last put the store did not
        take go out again, as nothing computes them again while they stay cached. Resident and referenced by the
        request now, so their gather is safe."""
        if self._refused:  # nearly always empty
            self.offload([(b, b.block_hash) for b in hits if b.block_hash in self._refused])

    def _offload_loop(self) -> None:
        from ragserve_cachestore.client import KVBlock

        yield_to_steps(self.cpus)
        while True:
            batch = [self._queue.get()]
            while batch[-1] is not None and len(batch) < 64:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            blocks, span = [], next((item[-1] for item in batch if item is not None), None)
            for h, gathered, i, _ in (item for item in batch if item is not None):
                raw = gathered.block_bytes(i)
                blocks.append(KVBlock(h, raw, "uint8", (len(raw),)))
            accepted = 0
            try:
                if blocks:
                    t0 = time.perf_counter()
                    with tracing.use(span):
                        put = self.client.put_blocks(blocks)
                    self.stats.offloaded += put.stored  # blocks newly stored
                    if accepted := put.accepted_bytes:  # what a down store dropped was not stored
                        self.stats.count_transfer("stored", accepted, time.perf_counter() - t0)
            except Exception:
                log.exception("cachestore offload failed")
            refused = accepted < sum(len(b.data) for b in blocks)  # computed again later, they go out again
            for b in blocks:
                if refused:
                    touch(self._refused, b.key)
                else:
                    self._refused.pop(b.key, None)
                self._pending.discard(b.key)  # after _refused: a refused block may be queued again from here on
            with self._sent_cv:
                self._sent += len(blocks)
                self._sent_cv.notify_all()
            for _ in batch:
                self._queue.task_done()
            if batch[-1] is None:
                return

    def remember(self, h: bytes) -> None:
        """A block stored or fetched: not offloaded while it stays among the recent ones."""
        touch(self._seen, h)

    def flush(self) -> None:
        """Wait until every queued offload was sent (each put has a deadline)."""
        self._queue.join()

    def save_mark(self) -> int:
        """The offload queue's end now: every block queued so far is sent once saved(mark) (kv_tail.py)."""
        return self._queued

    def saved(self, mark: int) -> bool:
        return self._sent >= mark

    def stored(self, keys: list[bytes]) -> bool:
        """Whether the store took the last put of each of these blocks (once saved: every put of them answered)."""
        return not any(h in self._refused for h in keys)

    def wait_saved(self, mark: int, timeout: float) -> None:
        with self._sent_cv:
            self._sent_cv.wait_for(lambda: self._sent >= mark, timeout)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
