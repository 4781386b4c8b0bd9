"""The engine's stored-KV counters (ragserve:kv_transfer_*{direction="stored"}) count only the block bytes a real
cachestore accepted: puts to a frozen (past the client's deadline) or dead store count nowhere; once it is back, the
next prompt's blocks count exactly. Blocks a put did not get into the store go out again, once at a time."""

from __future__ import annotations

import signal

import pytest

from ragserve_engine.sampling_params import SamplingParams
from tests.engine.test_kv_connector import GREEDY, engine
from tests.helpers.cachestore import CacheStoreProcess
from tests.helpers.engine_server import scrape
from tests.helpers.net import free_port
from tests.helpers.process import frozen, until

BLOCKS = 20  # full blocks per prompt (its 2 question tokens and 8 generated ones fill no other)
FIRST = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)  # a prefill leg


def prompt(seed: int) -> list[int]:
    return list(range(seed, seed + 16 * BLOCKS)) + [11, 12]


def serve(tmp_path, port: int, name: str, *args: str) -> CacheStoreProcess:
    return CacheStoreProcess(tmp_path / f"{name}.log", port, "--memory", "256MiB", *args).wait_serving()


@pytest.fixture
def store(tmp_path):
    procs = [serve(tmp_path, free_port(), "cachestore")]
    yield procs  # the test may replace procs[0] with a restarted store on the same port
    procs[0].stop()


def restart(store: list[CacheStoreProcess], tmp_path, client, *args: str) -> None:
    """The killed store back on its port, and answering the engine's client (its backoff over)."""
    store[0] = serve(tmp_path, store[0].port, "cachestore-restarted", *args)
    until(lambda: client.stats()[store[0].address] is not None, timeout=60, what="the restarted cachestore answers")


def test_stored_bytes_count_only_what_the_store_accepted(store, tmp_path):
    address = store[0].address
    llm = engine(address)
    connector = llm.engine.connector
    client = connector.client
    client.timeout_s = 0.5  # a frozen store fails the puts at this deadline
    stats, block_bytes = connector.stats, connector.kv_cache.block_nbytes

    def stored_after(seed: int) -> tuple[int, int, float]:
        llm.generate([prompt(seed)], GREEDY)
        connector.flush()
        return stats.offloaded, stats.transfer_bytes["stored"], stats.transfer_seconds["stored"]

    def reachable() -> bool:  # the client's backoff over, the store answers
        return client.stats()[address] is not None

    before = stored_after(1000)
    assert before[:2] == (BLOCKS, BLOCKS * block_bytes) and before[2] > 0
    with frozen([store[0].process]):
        assert stored_after(2000) == before  # every put ran past its deadline
    until(reachable, timeout=60, what="the thawed cachestore answers")
    offloaded, nbytes, seconds = stored_after(3000)
    assert (offloaded, nbytes) == (before[0] + BLOCKS, before[1] + BLOCKS * block_bytes) and seconds > before[2]

    store[0].stop(signal.SIGKILL)
    before = (offloaded, nbytes, seconds)
    assert stored_after(4000) == before  # refused: the store is down
    restart(store, tmp_path, client)
    offloaded, nbytes, _ = stored_after(5000)
    assert (offloaded, nbytes) == (before[0] + BLOCKS, before[1] + BLOCKS * block_bytes)
    kv = llm.engine.kv_manager
    assert client.lookup(kv.hash_blocks(prompt(4000), None)) == 0  # the store never had what counted nowhere
    assert client.lookup(kv.hash_blocks(prompt(5000), None)) == BLOCKS


def test_blocks_a_down_store_did_not_take_go_out_when_computed_again(store, tmp_path):
    """A put the store refused leaves its blocks unremembered: computed again (here after the prefix cache was
    reset), they are offloaded again, so peers find them once the store is back."""
    address = store[0].address
    llm = engine(address)
    connector, client, kv = llm.engine.connector, llm.engine.connector.client, llm.engine.kv_manager
    hashes = kv.hash_blocks(prompt(6000), None)
    store[0].stop(signal.SIGKILL)
    llm.generate([prompt(6000)], GREEDY)
    connector.flush()  # refused
    restart(store, tmp_path, client)
    assert client.lookup(hashes) == 0
    assert llm.engine.pool.reset_prefix_cache()
    llm.generate([prompt(6000)], GREEDY)
    connector.flush()
    assert client.lookup(hashes) == BLOCKS


def test_blocks_a_down_store_did_not_take_go_out_when_a_prompt_hits_them_locally(store, tmp_path):
    """Blocks the store refused that stay in the engine's prefix cache are never computed again there: a prompt
    that hits them locally puts them again, once, so a peer engine fetches them instead of recomputing them."""
    address = store[0].address
    llm = engine(address)
    connector, client, kv = llm.engine.connector, llm.engine.connector.client, llm.engine.kv_manager
    hashes = kv.hash_blocks(prompt(6500), None)
    store[0].stop(signal.SIGKILL)
    llm.generate([prompt(6500)], GREEDY)
    connector.flush()  # refused
    restart(store, tmp_path, client)
    assert client.lookup(hashes) == 0
    mark = connector.save_mark()
    out = llm.generate([prompt(6500)[:-2] + [13, 14]], GREEDY)[0]
    assert out.num_cached_tokens == BLOCKS * 16  # every full block a local hit: none computed again
    connector.flush()
    assert client.lookup(hashes) == BLOCKS and connector.save_mark() - mark == BLOCKS
    llm.generate([prompt(6500)[:-2] + [15, 16]], GREEDY)  # the store took them: another hit sends nothing
    assert connector.save_mark() - mark == BLOCKS
    peer = engine(address, loaded_model=llm.engine.runner.model)
    assert peer.generate([prompt(6500)[:-2] + [17, 18]], GREEDY)[0].num_cached_tokens == BLOCKS * 16
    assert peer.engine.connector.stats.hits == BLOCKS * 16  # fetched, not recomputed


def test_a_refused_block_is_queued_once_until_the_offload_thread_sent_it(store, tmp_path):
    """Blocks the store refused, computed again twice while the offload thread still holds an earlier put (to a
    frozen store, past which nothing in the queue is sent), are queued and put once, not once per computation."""
    address = store[0].address
    llm = engine(address)
    connector, client, kv = llm.engine.connector, llm.engine.connector.client, llm.engine.kv_manager
    hashes = kv.hash_blocks(prompt(9000), None)
    store[0].stop(signal.SIGKILL)
    llm.generate([prompt(9000)], GREEDY)
    connector.flush()  # refused
    metrics_port = free_port()
    restart(store, tmp_path, client, "--metrics-port", str(metrics_port))
    client.timeout_s = 120.0  # a call to the frozen store waits for it to thaw
    with frozen([store[0].process]):
        llm.generate([prompt(9100)], GREEDY)  # its put holds the offload thread (its fetch waits out its deadline)
        mark = connector.save_mark()
        for _ in range(2):  # computed again, twice: the first copy is still in the queue the second time
            assert llm.engine.pool.reset_prefix_cache()
            llm.generate([prompt(9000)], GREEDY)
        queued = connector.save_mark() - mark
    connector.flush()
    assert client.lookup(hashes) == BLOCKS
    counters = scrape(f"http://127.0.0.1:{metrics_port}")
    assert counters["ragserve_cachestore_puts_total{}"] == 2 * BLOCKS  # prompt(9100)'s blocks and these
    assert counters["ragserve_cachestore_puts_skipped_total{}"] == 0  # none put twice
    assert queued == BLOCKS


def test_a_prompt_counts_as_stored_only_when_the_store_took_every_block_of_it(store, tmp_path):
    """Prefill role (kv_tail.SavingOutputs): a prompt computed while the store is down still gets its answer once its
    puts were answered (refused), but counts as no prompt stored; one whose full blocks are local hits the store
    refused puts them again with its tail, and counts once the store took them all; so does one computed afresh whose
    full blocks the store holds by then and whose tail it refused before."""
    address = store[0].address
    llm = engine(address, role="prefill")
    connector, client, kv = llm.engine.connector, llm.engine.connector.client, llm.engine.kv_manager
    stored = connector.stats.transfer_requests

    def answer(tokens: list[int]) -> None:
        out = llm.generate([tokens], FIRST)[0]
        assert out.finished and len(out.outputs[0].token_ids) == 1

    answer(prompt(7000))
    assert stored["stored"] == 1
    store[0].stop(signal.SIGKILL)
    answer(prompt(8000))
    assert stored["stored"] == 1  # refused: not in the store
    restart(store, tmp_path, client)
    answer(prompt(8000)[:-2] + [13, 14, 15])  # its 20 full blocks: local hits the store refused, put again
    assert stored["stored"] == 2 and client.lookup(kv.hash_blocks(prompt(8000), None)) == BLOCKS
    assert llm.engine.pool.reset_prefix_cache()
    answer(prompt(8000))  # computed again: its tail (refused before) goes out, the store takes it
    assert stored["stored"] == 3
