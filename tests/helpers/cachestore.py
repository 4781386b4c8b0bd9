"""Helpers shared by the cachestore tests (fixtures live in conftest.py) and the engine tests that need a store."""

from __future__ import annotations

import hashlib
import signal
import sys
from pathlib import Path

import grpc

from ragserve.keys import KVLayout, store_key
from ragserve.v1 import cachestore_pb2 as pb
from ragserve_cachestore.client import KVBlock
from ragserve_cachestore.record import HEADER_SIZE, StoredBlock, checksum
from tests.helpers.process import start, wait_grpc

LAYOUT = KVLayout("model-a", "bfloat16", 16, 2, 2, 16).fingerprint()
OTHER_LAYOUT = KVLayout("model-b", "bfloat16", 16, 2, 2, 16).fingerprint()


def chain(n: int, seed: str = "doc") -> list[bytes]:
    """n distinct 32-byte keys (chained-hash shaped)."""
    return [hashlib.sha256(f"{seed}/{i}".encode()).digest() for i in range(n)]


def kv_blocks(n: int, size: int = 1024, seed: str = "doc") -> list[KVBlock]:
    """n bfloat16 blocks of `size` bytes with distinct contents."""
    out = []
    for i, key in enumerate(chain(n, seed)):
        data = (hashlib.sha256(key).digest() * (size // 32 + 1))[: size - 4] + i.to_bytes(4, "little")
        out.append(KVBlock(key, data, "bfloat16", (size // 2,)))
    return out


def pb_blocks(blocks: list[KVBlock]) -> list[pb.Block]:
    return [pb.Block(key=b.key, data=b.data, dtype=b.dtype, shape=b.shape, checksum=checksum(b.data)) for b in blocks]


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


SIZE = 1000
COST = SIZE + HEADER_SIZE  # what one block costs in a tier budget


def items(n: int, seed: str = "doc", size: int = SIZE) -> list[tuple[bytes, StoredBlock]]:
    return [
        (store_key(LAYOUT, b.key), StoredBlock(b.data, b.dtype, b.shape, checksum(b.data)))
        for b in kv_blocks(n, size, seed)
    ]


class CacheStoreProcess:
    """A real `ragserve cachestore` subprocess on 127.0.0.1:port, its output in `log`."""

    def __init__(self, log: Path, port: int, *args: str, env: dict | None = None) -> None:
        self.port, self.address = port, f"127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "ragserve.cli", "cachestore", "--host", "127.0.0.1", "--port", str(port), *args]
        if "--metrics-port" not in args:
            cmd += ["--metrics-port", "0"]
        self.process = start("cachestore", cmd, log, env=env)

    def wait_serving(self, credentials: grpc.ChannelCredentials | None = None) -> CacheStoreProcess:
        wait_grpc(self.address, credentials=credentials, proc=self.process)
        return self

    def stop(self, sig: int = signal.SIGTERM) -> int:
        return self.process.stop(sig)
