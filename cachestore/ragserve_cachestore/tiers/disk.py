"""Local disk tier: one file per block, DIR/<layout hex>/<block hash hex>, LRU by mtime.

Writes go to a temp file in the same directory, then os.replace: a reader sees a
whole record or none. Without fsync a crash can leave a short or zeroed file; the
header/data checksums turn that into a counted miss. On start the index is rebuilt
from the directory (oldest mtime first) and trimmed to the budget.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import uuid
from pathlib import Path

from ragserve.keys import HASH_BYTES
from ragserve.v1 import cachestore_pb2 as pb
from ragserve_cachestore.lru import LRUIndex
from ragserve_cachestore.record import LAYOUT_BYTES, StoredBlock, decode, encode_header
from ragserve_cachestore.tiers import TierError

log = logging.getLogger(__name__)
_LAYOUT_DIR = re.compile(rf"[0-9a-f]{{{2 * LAYOUT_BYTES}}}")
_BLOCK_FILE = re.compile(rf"[0-9a-f]{{{2 * HASH_BYTES}}}")
TMP_PREFIX = ".tmp-"


class DiskTier:
    kind = pb.TIER_DISK
    name = "disk"

    def __init__(self, root: str | Path, capacity: int) -> None:
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"cannot create disk tier directory {self.root}: {exc}") from None
        if not os.access(self.root, os.W_OK):
            raise ValueError(f"disk tier directory {self.root} is not writable")
        self.index = LRUIndex(capacity)
        self._rebuild()

    def path(self, key: bytes) -> Path:
        return self.root / key[:LAYOUT_BYTES].hex() / key[LAYOUT_BYTES:].hex()

    def read(self, key: bytes) -> StoredBlock:
        path = self.path(key)
        try:
            record = path.read_bytes()
        except FileNotFoundError:
            raise KeyError(key) from None
        except OSError as exc:
            raise TierError(f"reading {path}: {exc}") from exc
        block = decode(key, record)
        with contextlib.suppress(OSError):
            os.utime(path)  # LRU order survives a restart
        return block

    def write(self, key: bytes, block: StoredBlock) -> bool:
        path = self.path(key)
        tmp = path.with_name(f"{TMP_PREFIX}{uuid.uuid4().hex}")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(encode_header(key, block))
                f.write(block.data)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("disk tier: cannot write %s: %s", path, exc)
            tmp.unlink(missing_ok=True)
            return False
        self.index.add(key, block.size)
        return True

    def remove(self, key: bytes) -> None:
        self.index.discard(key)
        try:
            self.path(key).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("disk tier: cannot delete %s: %s", self.path(key), exc)

    def _rebuild(self) -> None:
        found: list[tuple[float, bytes, int]] = []
        for layout_dir in self.root.iterdir():
            if not (layout_dir.is_dir() and _LAYOUT_DIR.fullmatch(layout_dir.name)):
                continue
            for entry in os.scandir(layout_dir):
                if entry.name.startswith(TMP_PREFIX):
                    Path(entry.path).unlink(missing_ok=True)  # an interrupted write
                elif _BLOCK_FILE.fullmatch(entry.name) and entry.is_file():
                    stat = entry.stat()
                    key = bytes.fromhex(layout_dir.name + entry.name)
                    found.append((stat.st_mtime, key, stat.st_size))
        found.sort()
        self.index.fill(((key, size) for _, key, size in found), lambda key: self.path(key).unlink(missing_ok=True))
        log.info("disk tier %s: %d blocks, %d bytes", self.root, len(self.index), self.index.used)
