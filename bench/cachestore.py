"""Cachestore benchmark, part 1: KV-block transfer throughput over loopback gRPC vs. a raw socket copy.

Runs a real `ragserve cachestore` process and, in the same run, a raw TCP peer process that
moves the very same bytes; prints GB/s for put and get and the gRPC / raw-socket ratio.
Blocks are the size of one SmolLM2-135M KV block in bf16:
30 layers x 2 (K, V) x 16 tokens x 3 KV heads x 64 head dim x 2 bytes = 368,640 bytes.

    .venv/bin/python bench/cachestore.py [--quick] [--blocks N] [--repeats R] [--tag TAG]

Part 2: TTFT of engine B fetching a 2,048-token context's blocks (computed by engine A) from the
cachestore vs. an engine recomputing them (SmolLM2-135M, float32 CPU; target >= 10x), each measured
--repeats times, interleaved, with a new context each time. `--quick` uses a 1,024-token context;
`--skip-engine` runs part 1 only.

Every figure is the median of the repeats, with the min and max alongside; the results go to
bench/results/cachestore[-TAG].{json,md} with the command that produced them.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

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
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats; the median is reported")
    parser.add_argument("--skip-engine", action="store_true", help="part 1 only (no model load)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--tag", default="", help="suffix of the result file names")
    args = parser.parse_args()
    report: dict = {"command": " ".join(["python bench/cachestore.py", *sys.argv[1:]])}
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
        results: dict[str, list[float]] = {k: [] for k in ("grpc put", "grpc get", "socket put", "socket get")}
        warm = make_blocks(n, -1)
        client.put(warm)
        client.get([b.key for b in warm])
        socket_put(sock_port, [b.data for b in warm])
        for run in range(repeats):
            blocks = make_blocks(n, run)
            keys = [b.key for b in blocks]
            t, stored = timed(lambda blocks=blocks: client.put(blocks))
            assert stored == n, f"stored {stored} of {n}"
            results["grpc put"].append(t)
            t, got = timed(lambda keys=keys: client.get(keys))
            assert len(got) == n and got[-1].data == blocks[-1].data
            results["grpc get"].append(t)
            t, _ = timed(lambda blocks=blocks: socket_put(sock_port, [b.data for b in blocks]))
            results["socket put"].append(t)
            t, got = timed(lambda: socket_get(sock_port, total))
            assert len(got) == n
            results["socket get"].append(t)
        with socket.create_connection(("127.0.0.1", sock_port)) as conn:
            conn.sendall(struct.pack("<cQ", b"q", 0))
        peer.join(10)

    print(f"{n} blocks x {BLOCK_BYTES} B = {total / 1e6:.1f} MB per call, median of {repeats} (min-max)")
    print(f"{'transfer':<12}{'seconds':>10}{'GB/s':>10}{'GB/s range':>16}")
    transfer = {}
    for name, times in results.items():
        rates = sorted(total / t / 1e9 for t in times)
        transfer[name] = {"gb_per_s": statistics.median(rates), "min": rates[0], "max": rates[-1]}
        print(f"{name:<12}{statistics.median(times):>10.4f}{transfer[name]['gb_per_s']:>10.2f}"
              f"{rates[0]:>8.2f}-{rates[-1]:.2f}")  # fmt: skip
    for op in ("put", "get"):
        ratio = transfer[f"grpc {op}"]["gb_per_s"] / transfer[f"socket {op}"]["gb_per_s"]
        transfer[f"ratio {op}"] = ratio
        print(f"ratio {op}: gRPC throughput = {ratio:.2f} x raw socket (medians)")
    report["transfer"] = {"blocks": n, "block_bytes": BLOCK_BYTES, "repeats": repeats, **transfer}
    if not args.skip_engine:
        report["ttft"] = fetch_vs_recompute(1024 if args.quick else 2048, repeats)
    write_results(Path(args.out), "cachestore" + (f"-{args.tag}" if args.tag else ""), report)
    return 0


def write_results(out: Path, name: str, report: dict) -> None:
    (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    t = report["transfer"]
    lines = ["# Cachestore benchmark", "", f"Command: `{report['command']}`", ""]
    lines += [f"Part 1: {t['blocks']} blocks of {t['block_bytes']} B per call over loopback, median of "
              f"{t['repeats']} (min-max).", "", "| transfer | GB/s | range |", "|---|---:|---:|"]  # fmt: skip
    for k in ("grpc put", "grpc get", "socket put", "socket get"):
        lines.append(f"| {k} | {t[k]['gb_per_s']:.2f} | {t[k]['min']:.2f}-{t[k]['max']:.2f} |")
    lines += ["", f"gRPC / raw socket: put {t['ratio put']:.2f}x, get {t['ratio get']:.2f}x.", ""]
    if "ttft" in report:
        r = report["ttft"]
        lines += [f"Part 2: engine B's TTFT, {r['context_tokens']}-token context computed by engine A, median of "
                  f"{r['repeats']} interleaved runs (min-max).", ""]  # fmt: skip
        lines += ["| engine B | TTFT s | range |", "|---|---:|---:|"]
        for k in ("fetch", "recompute"):
            lines.append(f"| {k} | {r[k]['median']:.3f} | {r[k]['min']:.3f}-{r[k]['max']:.3f} |")
        lines += ["", f"Fetch is {r['speedup']:.1f}x faster than recompute (medians)."]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / name}.json and .md")


def fetch_vs_recompute(context_tokens: int, repeats: int) -> dict:
    """Engine A computes a context; engine B's TTFT with remote fetch vs. recompute, same weights, same run."""
    import random

    from ragserve_engine.llm import LLM
    from ragserve_engine.sampling_params import SamplingParams

    with running_cachestore(free_port(), memory=2 << 30) as address:
        rng = random.Random(0)
        one = SamplingParams(temperature=0.0, max_tokens=1)
        a = LLM("smollm2-135m", cachestore=address)
        b = LLM("smollm2-135m", cachestore=address, loaded_model=a.engine.runner.model)
        recompute = LLM("smollm2-135m", loaded_model=a.engine.runner.model)
        recompute.generate([[7, 8, 9]], one)  # warm both engines' code paths
        b.generate([[7, 8, 9]], one)
        times: dict[str, list[float]] = {"fetch": [], "recompute": []}
        for _ in range(repeats):  # a new context each time: nothing is local to engine B
            context = [rng.randrange(100, 49000) for _ in range(context_tokens)]
            a.generate([context + [11, 12, 13]], one)
            a.engine.connector.flush()
            question = context + [21, 22, 23, 24, 25]
            hits = b.engine.connector.stats.hits
            t, out = timed(lambda q=question: b.generate([q], one))
            assert b.engine.connector.stats.hits - hits >= context_tokens - 16, "engine B fetched too little"
            times["fetch"].append(t)
            times["recompute"].append(timed(lambda q=question: recompute.generate([q], one))[0])
        result = {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in times.items()}
        result.update(context_tokens=context_tokens, repeats=repeats)
        result["speedup"] = result["recompute"]["median"] / result["fetch"]["median"]
        print(f"\nTTFT, {context_tokens}-token context + question (SmolLM2-135M, float32 CPU), median of {repeats}")
        for k in ("fetch", "recompute"):
            print(f"{k:<12}{result[k]['median']:>10.3f} s  ({result[k]['min']:.3f}-{result[k]['max']:.3f})")
        print(f"ratio: fetch TTFT is {result['speedup']:.1f}x faster than recompute (target >= 10x)")
        return result


if __name__ == "__main__":
    sys.exit(main())
