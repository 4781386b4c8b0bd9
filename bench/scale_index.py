"""In-process figures of the router's exact KV index (router/ragserve_router/memory_state.py) for
bench/router_scale.py: KV-event ingestion (events and block hashes per second through MemoryState.apply, as
the registry applies a stream's batches), the index's memory at 1M blocks (tracemalloc), and match_exact's
time for one RAG prompt's hashes against 8 / 64 / 256 engines (the lookup kv_aware makes per request)."""

from __future__ import annotations

import asyncio
import hashlib
import time
import tracemalloc

from ragserve_router.memory_state import MemoryState
from ragserve_router.state import STORED, KVOp

EVENT_HASHES = 8  # hashes per BlocksStored event (a chained prefill's run of blocks)
BATCH_EVENTS = 64  # events per applied batch


def hashes(n: int, salt: int = 0) -> list[bytes]:
    return [hashlib.sha256(f"{salt}:{i}".encode()).digest() for i in range(n)]


async def ingest(blocks: int, engines: int) -> dict:
    state = MemoryState()
    keys = hashes(blocks)
    per = blocks // engines
    batches = []
    for e in range(engines):
        mine = keys[e * per : (e + 1) * per]
        ops = [KVOp(STORED, mine[i : i + EVENT_HASHES]) for i in range(0, len(mine), EVENT_HASHES)]
        batches += [(f"e{e}", ops[i : i + BATCH_EVENTS]) for i in range(0, len(ops), BATCH_EVENTS)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    for seq, (engine, ops) in enumerate(batches, 1):
        await state.apply(engine, ops, seq)
    wall = time.perf_counter() - t0
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    events = sum(len(ops) for _, ops in batches)
    return {
        "blocks": blocks,
        "engines": engines,
        "events_per_s": events / wall,
        "hashes_per_s": blocks / wall,
        "index_bytes": held,
        "bytes_per_block": held / blocks,
        "note": "hash bytes objects created before tracing are not counted: add 65 B per block (bytes of 32)",
    }


async def lookup(engines: int, prompt_blocks: int = 128, blocks_per_engine: int = 4000, reps: int = 200) -> dict:
    """match_exact over every engine for a prompt the last engine holds whole (a kv_aware decision's lookup)."""
    state = MemoryState()
    prompt = hashes(prompt_blocks, salt=1)
    for e in range(engines):
        own = hashes(blocks_per_engine, salt=100 + e) + (prompt if e == engines - 1 else [])
        await state.apply(f"e{e}", [KVOp(STORED, own)], 1)
    ids = [f"e{e}" for e in range(engines)]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        await state.match_exact(ids, prompt)
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"engines": engines, "prompt_blocks": prompt_blocks, "p50_ms": 1000 * times[len(times) // 2]}


def index_figures(fleets: list[int], blocks: int = 1_000_000) -> dict:
    async def run() -> dict:
        return {"ingest": await ingest(blocks, 64), "match_exact": [await lookup(n) for n in fleets]}

    return asyncio.run(run())
