"""Cachestore benchmark, part 1: KV-block transfer throughput over loopback gRPC vs. a raw socket copy.

Runs a real `ragserve cachestore` process and, in the same run, a raw TCP peer process that
moves the very same bytes; prints GB/s for put and get and the gRPC / raw-socket ratio.
Blocks are the size of one SmolLM2-135M KV block in bf16:
30 layers x 2 (K, V) x 16 tokens x 3 KV heads x 64 head dim x 2 bytes = 368,640 bytes.

    .venv/bin/python bench/cachestore.py [--quick] [--blocks N] [--repeats R]

Part 2: TTFT of engine B fetching a 2,048-token context's blocks (computed by engine A) from the
cachestore vs. an engine recomputing them (SmolLM2-135M, float32 CPU; target >= 10x). `--quick`
uses a 1,024-token context; `--skip-engine` runs part 1 only.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import multiprocessing
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc

from ragserve.keys import KVLayout
from ragserve.stack.spec import free_port
from ragserve_cachestore.client import CacheStoreClient, KVBlock

BLOCK_SHAPE = (30, 2, 16, 3, 64)  # layers, K/V, tokens, KV heads, head dim (bf16)
BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 2
LAYOUT = KVLayout("bench-smollm2-135m", "bfloat16", 16, 30, 3, 64).fingerprint()
CHUNK = 1 << 20


# -- raw socket baseline: a peer process that sinks (put) or sources (get) N bytes -------------------------


def socket_peer(port: int, ready) -> None:
    payload = os.urandom(CHUNK)
    with socket.create_server(("127.0.0.1", port)) as server:
        ready.set()
        while True:
            conn, _ = server.accept()
            with conn:
                op, n = struct.unpack("<cQ", _recv_exact(conn, 9))
                if op == b"q":
                    return
                if op == b"p":
                    buf = bytearray(CHUNK)
                    while n > 0:
                        n -= conn.recv_into(buf, min(n, CHUNK))
                    conn.sendall(b"k")
                else:
                    while n > 0:
                        n -= conn.send(memoryview(payload)[: min(n, CHUNK)])


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        more = conn.recv(n - len(data))
        if not more:
            raise ConnectionError("peer closed")
        data += more
    return data


def socket_put(port: int, blocks: list[bytes]) -> None:
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(struct.pack("<cQ", b"p", sum(len(b) for b in blocks)))
        for block in blocks:
            conn.sendall(block)
        assert conn.recv(1) == b"k"


def socket_get(port: int, total: int) -> list[bytes]:
    out = []
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(struct.pack("<cQ", b"g", total))
        for _ in range(total // BLOCK_BYTES):
            buf = bytearray(BLOCK_BYTES)
            view, got = memoryview(buf), 0
            while got < BLOCK_BYTES:
                got += conn.recv_into(view[got:], BLOCK_BYTES - got)
            out.append(bytes(buf))  # the gRPC client also hands out one bytes object per block
    return out


# -- gRPC: a real `ragserve cachestore` process -------------------------------------------------------------


@contextlib.contextmanager
def running_cachestore(port: int, memory: int) -> Iterator[str]:
    """A `ragserve cachestore` process on 127.0.0.1:port, yielded once it accepts connections; stopped on exit."""
    cmd = [sys.executable, "-m", "ragserve.cli", "cachestore", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--memory", str(memory), "--metrics-port", "0", "--log-level", "WARNING"]
    store = subprocess.Popen(cmd)
    address = f"127.0.0.1:{port}"
    try:
        with grpc.insecure_channel(address) as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
        yield address
    finally:
        store.terminate()
        store.wait(15)


def make_blocks(n: int, run: int) -> list[KVBlock]:
    pattern = os.urandom(BLOCK_BYTES)
    out = []
    for i in range(n):
        key = hashlib.sha256(f"bench/{run}/{i}".encode()).digest()
        out.append(KVBlock(key, key + pattern[32:], "bfloat16", BLOCK_SHAPE))
    return out


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 blocks x 2 repeats (a smoke run)")
    parser.add_argument("--blocks", type=int, default=512, help="blocks per call")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats; the best is reported")
    parser.add_argument("--skip-engine", action="store_true", help="part 1 only (no model load)")
    args = parser.parse_args()
    n, repeats = (64, 2) if args.quick else (args.blocks, args.repeats)
    total = n * BLOCK_BYTES

    sock_port, grpc_port = free_port(), free_port()
    ready = multiprocessing.get_context("spawn").Event()
    peer = multiprocessing.get_context("spawn").Process(target=socket_peer, args=(sock_port, ready), daemon=True)
    peer.start()
    with (
        running_cachestore(grpc_port, memory=(repeats + 1) * total * 2) as address,
        CacheStoreClient([address], LAYOUT, timeout_s=120) as client,
    ):
        ready.wait(30)
        results = {k: float("inf") for k in ("grpc put", "grpc get", "socket put", "socket get")}
        warm = make_blocks(n, -1)
        client.put(warm)
        client.get([b.key for b in warm])
        socket_put(sock_port, [b.data for b in warm])
        for run in range(repeats):
            blocks = make_blocks(n, run)
            keys = [b.key for b in blocks]
            t, stored = timed(lambda blocks=blocks: client.put(blocks))
            assert stored == n, f"stored {stored} of {n}"
            results["grpc put"] = min(results["grpc put"], t)
            t, got = timed(lambda keys=keys: client.get(keys))
            assert len(got) == n and got[-1].data == blocks[-1].data
            results["grpc get"] = min(results["grpc get"], t)
            t, _ = timed(lambda blocks=blocks: socket_put(sock_port, [b.data for b in blocks]))
            results["socket put"] = min(results["socket put"], t)
            t, got = timed(lambda: socket_get(sock_port, total))
            assert len(got) == n
            results["socket get"] = min(results["socket get"], t)
        with socket.create_connection(("127.0.0.1", sock_port)) as conn:
            conn.sendall(struct.pack("<cQ", b"q", 0))
        peer.join(10)

    print(f"{n} blocks x {BLOCK_BYTES} B = {total / 1e6:.1f} MB per call, best of {repeats}")
    print(f"{'transfer':<12}{'seconds':>10}{'GB/s':>10}")
    for name, seconds in results.items():
        print(f"{name:<12}{seconds:>10.4f}{total / seconds / 1e9:>10.2f}")
    for op in ("put", "get"):
        ratio = results[f"socket {op}"] / results[f"grpc {op}"]
        print(f"ratio {op}: gRPC throughput = {ratio:.2f} x raw socket")
    if not args.skip_engine:
        fetch_vs_recompute(1024 if args.quick else 2048)
    return 0


def fetch_vs_recompute(context_tokens: int) -> None:
    """Engine A computes a context; engine B's TTFT with remote fetch vs. recompute, same weights, same run."""
    import random

    from ragserve_engine.llm import LLM
    from ragserve_engine.sampling_params import SamplingParams

    with running_cachestore(free_port(), memory=2 << 30) as address:
        rng = random.Random(0)
        context = [rng.randrange(100, 49000) for _ in range(context_tokens)]
        one = SamplingParams(temperature=0.0, max_tokens=1)
        a = LLM("smollm2-135m", cachestore=address)
        a.generate([context + [11, 12, 13]], one)
        a.engine.connector.flush()
        b = LLM("smollm2-135m", cachestore=address, loaded_model=a.engine.runner.model)
        recompute = LLM("smollm2-135m", loaded_model=a.engine.runner.model)
        question = context + [21, 22, 23, 24, 25]
        recompute.generate([[7, 8, 9]], one)  # warm both engines' code paths
        b.generate([[7, 8, 9]], one)
        t_fetch, out = timed(lambda: b.generate([question], one))
        t_recompute, _ = timed(lambda: recompute.generate([question], one))
        fetched = b.engine.connector.stats.hits
        print(f"\nTTFT, {context_tokens}-token context + question (SmolLM2-135M, float32 CPU)")
        print(f"{'engine B':<22}{'seconds':>10}")
        print(
            f"{'fetch from cachestore':<22}{t_fetch:>10.3f}  ({fetched} tokens fetched, "
            f"{out[0].num_cached_tokens} cached)"
        )
        print(f"{'recompute':<22}{t_recompute:>10.3f}")
        print(f"ratio: fetch TTFT is {t_recompute / t_fetch:.1f}x faster than recompute (target >= 10x)")


if __name__ == "__main__":
    sys.exit(main())
