"""One vLLM engine's KV events (one data-parallel rank) turned into the router's index ops, in ragserve's keys.

vLLM's block hashes are opaque (seeded per process), so each `BlockStored` is keyed again from its
`token_ids` with ragserve/keys.py, chained on the parent's ragserve key, and the engine hash -> key map
lets `BlockRemoved` (hashes only) apply. Blocks on another medium than the GPU (CPU, disk offload) go to
a second index id, `<index id>@<medium>`, so that a cost model can price them between a GPU hit and a
recompute. Copies are counted: a key leaves an index only when its last copy there is removed.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from ragserve.keys import hash_block, root_hash
from ragserve.vllm_events.wire import MEDIUM_GPU, AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent
from ragserve_router.state import CLEARED, REMOVED, STORED, KVOp

FULL_ATTENTION = "full_attention"
LORA_NAMESPACE = "lora:"  # blocks of a LoRA adapter chain from root_hash(model, "lora:<name>")
OTHER_EXTRA = b"vllm-extra:"  # extra hash inputs ragserve's prompt keys never carry (multimodal hashes)


class BlockSizeMismatch(ValueError):
    """The engine hashes blocks of another size than the pool: its blocks can never match a prompt's."""


@dataclass
class IndexerStats:
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    unknown_removed: int = 0  # BlockRemoved of a hash never stored (or stored before a clear)
    unknown_parent: int = 0  # BlockStored whose parent was never stored: cannot be keyed, skipped
    malformed: int = 0  # BlockStored whose token_ids are not len(block_hashes) full blocks
    other_group: int = 0  # events of a group other than full attention, ignored


@dataclass
class VllmIndexer:
    index_id: str  # the state's engine id for this engine's (this rank's) GPU blocks
    model_id: str
    block_size: int
    stats: IndexerStats = field(default_factory=IndexerStats)

    def __post_init__(self) -> None:
        self._keys: dict[BlockHash, bytes] = {}  # engine hash -> ragserve key, while held on any medium
        self._copies: defaultdict[str, Counter[BlockHash]] = defaultdict(Counter)  # medium -> engine hash copies
        self._key_refs: defaultdict[str, Counter[bytes]] = defaultdict(Counter)  # medium -> ragserve key refs
        self._full_groups: set[int] = set()
        self._other_groups: set[int] = set()

    def tier_id(self, medium: str | None) -> str:
        """State engine id of one medium's blocks: the index id itself for GPU."""
        medium = medium or MEDIUM_GPU
        return self.index_id if medium == MEDIUM_GPU else f"{self.index_id}@{medium}"

    def offload_tiers(self) -> list[tuple[str, str]]:
        """(state id, medium) of the media other than the GPU that blocks were stored on."""
        return [(self.tier_id(m), m) for m in self._copies if m != MEDIUM_GPU]

    def events(self, events: list[KVEvent]) -> dict[str, list[KVOp]]:
        """Index ops per state engine id, in order, for one batch."""
        ops: defaultdict[str, list[KVOp]] = defaultdict(list)
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(event, ops)
            elif isinstance(event, BlockRemoved):
                self._removed(event, ops)
            elif isinstance(event, AllBlocksCleared):
                self._clear(ops)
        return dict(ops)

    def cold(self) -> dict[str, list[KVOp]]:
        """The engine's picture is lost (restart, unreplayable gap): forget all of it."""
        ops: defaultdict[str, list[KVOp]] = defaultdict(list)
        self._clear(ops)
        return dict(ops)

    def _clear(self, ops: defaultdict[str, list[KVOp]]) -> None:
        for medium in set(self._copies) | {MEDIUM_GPU}:
            ops[self.tier_id(medium)].append(KVOp(CLEARED, []))
        self._keys.clear()
        self._copies.clear()
        self._key_refs.clear()
        self.stats.cleared += 1

    def _stored(self, event: BlockStored, ops: defaultdict[str, list[KVOp]]) -> None:
        if not self._is_full_group(event):
            self.stats.other_group += 1
            return
        if event.block_size != self.block_size:
            raise BlockSizeMismatch(
                f"engine {self.index_id} publishes blocks of {event.block_size} tokens but the pool hashes "
                f"{self.block_size}-token blocks: its blocks can never match the router's prompt hashes; "
                f"run vLLM with --block-size {self.block_size}"
            )
        if len(event.token_ids) != len(event.block_hashes) * self.block_size:
            self.stats.malformed += 1
            return
        keys = self._keys_of(event)
        if keys is None:
            self.stats.unknown_parent += 1
            return
        medium = event.medium or MEDIUM_GPU
        new = [k for h, k in zip(event.block_hashes, keys, strict=True) if self._hold(medium, h, k)]
        if new:
            ops[self.tier_id(medium)].append(KVOp(STORED, new))
        self.stats.stored += len(keys)

    def _keys_of(self, event: BlockStored) -> list[bytes] | None:
        """ragserve's chained keys of the event's blocks, or None when the parent is unknown."""
        if event.parent_block_hash is None:
            lora = lora_of(event)
            namespace = f"{LORA_NAMESPACE}{lora}" if lora is not None else ""
            parent = root_hash(self.model_id, namespace)
            first = True
        else:
            parent = self._keys.get(event.parent_block_hash)
            if parent is None:
                return None
            first = False
        keys = []
        for i in range(len(event.block_hashes)):
            tokens = event.token_ids[i * self.block_size : (i + 1) * self.block_size]
            extra = block_extra(event, i, first and i == 0)
            parent = hash_block(parent, tokens, extra)
            keys.append(parent)
        return keys

    def _hold(self, medium: str, engine_hash: BlockHash, key: bytes) -> bool:
        """Count one copy; True when the key is new on this medium."""
        self._keys.setdefault(engine_hash, key)
        self._copies[medium][engine_hash] += 1
        refs = self._key_refs[medium]
        refs[key] += 1
        return refs[key] == 1

    def _removed(self, event: BlockRemoved, ops: defaultdict[str, list[KVOp]]) -> None:
        if not self._group_is_full(event.group_idx):
            self.stats.other_group += 1
            return
        medium = event.medium or MEDIUM_GPU
        gone = [k for h in event.block_hashes if (k := self._release(medium, h)) is not None]
        if gone:
            ops[self.tier_id(medium)].append(KVOp(REMOVED, gone))

    def _release(self, medium: str, engine_hash: BlockHash) -> bytes | None:
        """Drop one copy; the ragserve key when its last copy on this medium went."""
        copies = self._copies.get(medium)
        if not copies or copies[engine_hash] <= 0:
            self.stats.unknown_removed += 1
            return None
        self.stats.removed += 1
        key = self._keys[engine_hash]
        copies[engine_hash] -= 1
        if copies[engine_hash] == 0:
            del copies[engine_hash]
            if not any(engine_hash in c for c in self._copies.values()):
                del self._keys[engine_hash]
        refs = self._key_refs[medium]
        refs[key] -= 1
        if refs[key] > 0:
            return None
        del refs[key]
        return key

    def _is_full_group(self, event: BlockStored) -> bool:
        group = event.group_idx
        if event.kv_cache_spec_kind is None:
            full = self._group_is_full(group)
        else:
            full = event.kv_cache_spec_kind == FULL_ATTENTION
        if group is not None:
            (self._full_groups if full else self._other_groups).add(group)
        return full

    def _group_is_full(self, group: int | None) -> bool:
        """Without a kind on the wire, group 0 (or none) is the full-attention group unless a kind said otherwise."""
        return group is None or group in self._full_groups or (group == 0 and group not in self._other_groups)


def block_extra(event: BlockStored, i: int, chain_start: bool) -> bytes:
    """ragserve's extra hash input for block i: the cache salt on a chain's first block, as ragserve keys
    a salted prompt; any other extra input (multimodal hashes) keys the block apart from every prompt key."""
    extras = list(event.extra_keys[i] or ()) if event.extra_keys and i < len(event.extra_keys) else []
    lora = lora_of(event)
    if lora is not None and extras and extras[0] == lora:
        extras.pop(0)  # vLLM puts the LoRA first; the chain's root already carries it
    if not extras:
        return b""
    if chain_start and len(extras) == 1 and isinstance(extras[0], str):
        return extras[0].encode()  # vLLM's cache_salt, block 0's only extra
    return OTHER_EXTRA + repr(extras).encode()


def lora_of(event: BlockStored) -> str | int | None:
    """The adapter the blocks were computed with: its name, or its int id (what older vLLMs hash)."""
    return event.lora_name if event.lora_name else event.lora_id
