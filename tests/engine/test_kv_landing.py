"""Fetched KV lands in the paged cache a bounded number of blocks per step (remote_fetches.IMPORT_BLOCKS_PER_STEP):
a long prompt's blocks (a disaggregated decode engine's ~100 MB) never stretch one step of the requests decoding
beside it; the landed blocks stay pinned until the request is admitted; the output is the cold run's. The transfer
threads run at a lower CPU priority than the step thread."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from concurrent.futures import Future

import pytest

from ragserve_engine import remote_fetches
from ragserve_engine.kv_connector import PendingFetch
from ragserve_engine.kv_offload import BACKGROUND_NICE
from ragserve_engine.sampling_params import SamplingParams
from tests.engine.test_kv_connector import CONTEXT, GREEDY, engine
from tests.helpers.cachestore import CacheStoreProcess
from tests.helpers.net import free_port
from tests.helpers.process import until

PER_STEP = 6  # 20 context blocks land over 4 steps
LIBC = ctypes.CDLL(None, use_errno=True)
MADV_DONTNEED = 4  # linux/mman.h


@pytest.fixture
def cachestore(tmp_path):
    store = CacheStoreProcess(tmp_path / "cachestore.log", free_port(), "--memory", "256MiB").wait_serving()
    yield store.address
    store.stop()


@pytest.fixture
def small_landing(monkeypatch):
    monkeypatch.setattr(remote_fetches, "IMPORT_BLOCKS_PER_STEP", PER_STEP)


def stored_context(address: str):
    a = engine(address)
    question = CONTEXT + [61]
    reference = a.generate([question], GREEDY)[0]
    a.engine.connector.flush()
    return a, question, reference


def test_a_long_fetch_lands_over_steps_while_others_decode(cachestore, small_landing):
    address = cachestore
    a, question, reference = stored_context(address)
    b = engine(address, loaded_model=a.engine.runner.model)
    eng = b.engine
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    eng.add_request("bystander", list(range(9000, 9020)), long)
    eng.step()  # the bystander's prefill: it decodes from now on
    eng.add_request("question", question, GREEDY)
    landed, bystander_tokens, finished = [], [], {}
    while eng.has_unfinished_requests():
        outs = eng.step()
        finished.update((out.request_id, out) for out in outs if out.finished)
        pending = next(iter(eng.scheduler.remote.pending.values()), None)
        if pending is not None and pending.landed:
            landed.append(pending.landed)
            bystander_tokens.append(sum(out.request_id == "bystander" for out in outs))
    # it landed in steps of at most PER_STEP blocks, the bystander decoding a token in each of them
    assert landed == [6, 12, 18]  # then the last 2 and the admission, in the same step
    assert bystander_tokens == [1, 1, 1]
    assert finished["question"].num_cached_tokens == 20 * 16
    assert finished["question"].outputs[0].token_ids == reference.outputs[0].token_ids
    assert eng.connector.stats.hits == 20 * 16 and eng.connector.stats.not_imported == 0


def test_landed_blocks_are_pinned_until_the_last_lands_or_the_fetch_is_abandoned(cachestore):
    address = cachestore
    a, _, _ = stored_context(address)
    hashes = a.engine.kv_manager.hash_blocks(CONTEXT, None)
    blocks = a.engine.connector.client.get(hashes)
    assert len(blocks) == 20

    def fresh():
        kv = engine(address, loaded_model=a.engine.runner.model).engine
        done: Future = Future()
        done.set_result((blocks, 0.01))
        refs = lambda: [b.ref_cnt if (b := kv.kv_manager.pool.get_cached_block(h)) else -1 for h in hashes]  # noqa: E731
        return kv.connector, PendingFetch(hashes, 0, done, deadline=0.0), refs

    conn, whole, refs = fresh()
    assert conn.finish_fetch(whole, 8) is None and conn.finish_fetch(whole, 8) is None
    assert refs() == [1] * 16 + [-1] * 4  # landed and held; the rest not yet cached
    assert conn.finish_fetch(whole, 8) == 20
    assert refs() == [0] * 20  # cached and free: the admission hits them
    assert conn.stats.hits == 20 * 16

    conn, cut, refs = fresh()  # the request aborted after one piece landed
    assert conn.finish_fetch(cut, 8) is None
    conn.abandon(cut)
    assert cut.held is None and refs() == [0] * 8 + [-1] * 12  # nothing left pinned


def test_transfer_threads_yield_the_core_to_the_step_thread(cachestore):
    """The fetch and offload threads run at BACKGROUND_NICE over the step thread's priority (Linux nice is per
    thread): their copies and (de)serialization do not stretch the steps of the requests decoding beside them."""
    address = cachestore
    a, question, _ = stored_context(address)  # ran an offload
    b = engine(address, loaded_model=a.engine.runner.model)
    b.generate([question], GREEDY)  # ran a fetch
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    nice = {t.name.split("_")[0]: os.getpriority(os.PRIO_PROCESS, t.native_id) for t in threading.enumerate()}
    assert nice["kv-offload"] == nice["kv-fetch"] == min(19, mine + BACKGROUND_NICE)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine


def test_transfer_threads_run_on_the_cpus_named(cachestore):
    """--kv-transfer-cpus: the fetch and offload threads move onto those CPUs, off the step thread's core; the
    step thread stays where it was, and the fetched KV is the same."""
    mine = os.sched_getaffinity(0)
    cpus = (max(mine),)
    a, question, reference = stored_context(cachestore)
    b = engine(cachestore, loaded_model=a.engine.runner.model, kv_transfer_cpus=cpus)
    out = b.generate([question], GREEDY)[0]  # ran a fetch
    conn = b.engine.connector
    assert conn.stats.hits > 0 and out.outputs[0].token_ids == reference.outputs[0].token_ids
    threads = [conn.offloader._thread, *conn._fetch_pool._threads]
    assert len(threads) >= 2 and all(os.sched_getaffinity(t.native_id) == set(cpus) for t in threads)
    assert os.sched_getaffinity(0) == mine


def pages(cache, block_id: int, inner: bool = False) -> tuple[int, int]:
    """The (start address, count) of the pages a block's memory touches, or of those wholly inside it (inner):
    blocks need not be page-aligned, so a block can share its first and last page with its neighbours."""
    page, size = mmap.PAGESIZE, cache.block_nbytes
    addr = cache.data.data_ptr() + block_id * size
    start = -(-addr // page) * page if inner else addr - addr % page
    end = (addr + size) // page * page if inner else -(-(addr + size) // page) * page
    return start, max(0, end - start) // page


def resident(cache, block_id: int, inner: bool = False) -> bool:
    """Whether every page of a block's memory is backed (mincore)."""
    start, count = pages(cache, block_id, inner)
    vec = (ctypes.c_ubyte * count)()
    assert LIBC.mincore(ctypes.c_void_p(start), ctypes.c_size_t(count * mmap.PAGESIZE), vec) == 0
    return all(v & 1 for v in vec)


def evict(cache, block_ids: list[int]) -> None:
    """Give the OS back the pages wholly inside these (free) blocks (MADV_DONTNEED: they read as zeros again), as a
    fresh cache's are: with transparent huge pages (numpy asks for them) one write backs 2 MB, the blocks around
    it included, so a fresh engine's next free blocks can be backed already."""
    for block_id in block_ids:
        start, count = pages(cache, block_id, inner=True)
        assert LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(count * mmap.PAGESIZE), MADV_DONTNEED) == 0


def test_a_fetch_backs_the_blocks_it_lands_in_off_the_step_thread(cachestore):
    """The CPU cache's pages are backed as they are first written (kv_cache.zeros), a page fault per page for the
    thread that writes first: the fetch thread backs the blocks the fetched KV will land in, so the step thread's
    landing copy takes none (on a VM ~1.7 ms per 0.7 MB SmolLM2 block: a 2k-token prompt stretched 4 steps by
    ~55 ms each in bench/disagg.py). Backing keeps a block's bytes."""
    a, question, reference = stored_context(cachestore)
    # 64 MB of 8 KB blocks: past glibc's largest mmap threshold (32 MB), fresh pages from the OS as a real cache's
    b = engine(cachestore, num_gpu_blocks=8192, loaded_model=a.engine.runner.model)
    cache = b.engine.connector.kv_cache
    assert cache is b.engine.runner.kv_cache
    landing = b.engine.kv_manager.next_free_block_ids(20)
    evict(cache, landing)
    assert not any(resident(cache, i, inner=True) for i in landing)
    written, write = [], cache.write_block

    def observed(block_id: int, raw: bytes) -> None:
        written.append((block_id, resident(cache, block_id)))
        write(block_id, raw)

    cache.write_block = observed
    out = b.generate([question], GREEDY)[0]
    assert sorted(i for i, _ in written) == sorted(landing)
    assert all(backed for _, backed in written)  # backed before the step thread wrote them
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids and out.num_cached_tokens == 20 * 16

    written, fresh = 4096, 8191  # free, 32 MB apart: not in one (huge) page, nor near the blocks the fetch backed
    assert {written, fresh} <= set(b.engine.kv_manager.next_free_block_ids(8192))
    cache.data[written] = 7.0
    evict(cache, [fresh])
    assert not resident(cache, fresh, inner=True)
    cache.back([written, fresh])
    assert resident(cache, fresh) and bool((cache.data[fresh] == 0).all())
    assert bool((cache.data[written] == 7.0).all())


def test_fetches_in_flight_together_back_the_blocks_each_lands_in(cachestore):
    """Two requests fetching at once land one after the other from the free queue's head: the second backs the
    blocks after the first's, so every block either lands in was backed (with huge pages the tiny model's blocks
    share pages, so this watches which blocks each fetch backs)."""
    a = engine(cachestore)
    other = list(range(7000, 7000 + 16 * 20))
    questions = [CONTEXT + [61], other + [61]]
    reference = a.generate(questions, GREEDY)
    a.engine.connector.flush()
    b = engine(cachestore, loaded_model=a.engine.runner.model)
    cache = b.engine.connector.kv_cache
    backed, written, back, write = [], [], cache.back, cache.write_block
    cache.back = lambda ids: (backed.append(list(ids)), back(ids))[1]
    cache.write_block = lambda block_id, raw: (written.append(block_id), write(block_id, raw))[1]
    outs = b.generate(questions, GREEDY)
    assert len(backed) == 2 and set(backed[0][:20]).isdisjoint(backed[1][:20])  # each its own 20, then a margin
    assert len(written) == 40 and set(written) <= set(backed[0]) | set(backed[1])
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in reference]
    assert [o.num_cached_tokens for o in outs] == [20 * 16] * 2


def test_a_decode_engine_backs_its_whole_cache_at_start(cachestore):
    """--role decode lands every prompt's KV in fresh blocks: a background thread backs its whole cache at start,
    so no fetch backs blocks on the request path; a `both` engine backs none up front (its cache costs nothing
    until used)."""
    both = engine(cachestore, num_gpu_blocks=8192)  # 64 MB: mapped afresh, not heap memory a freed cache used
    blocks = range(both.engine.pool.num_blocks)
    # right away: given time, the host may back a sparsely touched cache itself (khugepaged or DAMON collapsing its
    # 2 MB regions into huge pages: a CI run saw the whole of it resident after the wait below)
    assert not all(resident(both.engine.runner.kv_cache, i) for i in blocks)
    decode = engine(cachestore, num_gpu_blocks=8192, role="decode", loaded_model=both.engine.runner.model)
    until(lambda: all(resident(decode.engine.runner.kv_cache, i) for i in blocks), timeout=60, what="cache backed")
    assert not both.engine.runner.kv_cache.backed  # never backed all of it by itself
    kv_cache = decode.engine.runner.kv_cache
    until(lambda: kv_cache.backed, timeout=60, what="back_all done")  # then a fetch backs nothing again
    evict(kv_cache, [5])
    kv_cache.back([5])
    assert not resident(kv_cache, 5, inner=True)  # (a real engine never evicts: this shows back() skipped)
