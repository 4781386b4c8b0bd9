"""Block hashes of prompts that share long prefixes, resumed from a kept point of their chain.

A RAG prompt is mostly a context seen before, and a chat turn is the turn before plus a little: hashing every block
of a 3k-token prompt again costs ~0.15 ms of CPU (twice that in a live router). The chain's hashes are kept at every
STRIDE-th block under a digest of everything they depend on (root, salt, block size, the tokens up to there: one
SHA-256 pass over the prompt, ~6 us for 3k tokens), so a prompt hashes only the blocks after its longest kept point.
The result is keys.block_hashes' exactly.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence

from ragserve.keys import _checked_parent, _lp, _pack_tokens, block_hashes, hash_packed

STRIDE = 16  # blocks between kept points; a prompt of fewer full blocks is hashed as it is
CAPACITY_BLOCKS = 1 << 17  # hashes kept (~10 MB)
_SCHEME = b"ragserve-prefix-points-v1"


class PrefixHashes:
    """block_hashes(token_ids, block_size, root, cache_salt), resumed from kept points. Safe from several threads."""

    def __init__(self, capacity_blocks: int = CAPACITY_BLOCKS) -> None:
        self.capacity_blocks = capacity_blocks
        self._points: OrderedDict[bytes, tuple[bytes, ...]] = OrderedDict()  # digest: the STRIDE hashes before it
        self.hits = self.misses = 0  # prompts that resumed from a kept point, and that did not
        self._lock = threading.Lock()

    def __call__(
        self, token_ids: Sequence[int], block_size: int, root: bytes, cache_salt: str | None = None
    ) -> list[bytes]:
        if block_size <= 0 or (end := len(token_ids) // block_size) < STRIDE:
            return block_hashes(token_ids, block_size, root, cache_salt)
        _checked_parent(root)
        packed = _pack_tokens(token_ids[: end * block_size])
        salt = cache_salt.encode() if cache_salt else b""
        digests = _digests(packed, block_size, root, salt)
        chain = self._kept(digests)
        if chain:
            chain += hash_packed(chain[-1], packed[len(chain) * 4 * block_size :], block_size)
        else:
            chain = hash_packed(root, packed, block_size, salt)
        self._keep(digests, chain)
        return chain

    def _kept(self, digests: list[bytes]) -> list[bytes]:
        """The chain up to the last of the leading kept points ([] for none)."""
        chain: list[bytes] = []
        with self._lock:
            for digest in digests:
                if (hashes := self._points.get(digest)) is None:
                    break
                self._points.move_to_end(digest)
                chain += hashes
            if chain:
                self.hits += 1
            else:
                self.misses += 1
        return chain

    def _keep(self, digests: list[bytes], chain: list[bytes]) -> None:
        with self._lock:
            for k, digest in enumerate(digests):
                if digest not in self._points:
                    self._points[digest] = tuple(chain[k * STRIDE : (k + 1) * STRIDE])
            while len(self._points) * STRIDE > self.capacity_blocks:
                self._points.popitem(last=False)

    @property
    def blocks(self) -> int:
        """Hashes kept."""
        return len(self._points) * STRIDE


def _digests(packed: bytes, block_size: int, root: bytes, salt: bytes) -> list[bytes]:
    """The digest of each kept point's prefix: every STRIDE blocks of `packed`."""
    h = hashlib.sha256(_SCHEME + _lp(root) + _lp(salt) + struct.pack("<I", block_size))
    step = STRIDE * 4 * block_size
    out = []
    for at in range(step, len(packed) + 1, step):
        h.update(packed[at - step : at])
        out.append(h.copy().digest())
    return out


prefix_block_hashes = PrefixHashes()  # the process's kept points: router, engine and sim engine hash with it
