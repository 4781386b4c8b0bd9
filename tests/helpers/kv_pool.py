"""A KV-cache manager on a unit-test layout, and a sequence admitted to it as the scheduler would."""

from __future__ import annotations

from ragserve.keys import KVLayout
from ragserve_engine.kv_cache_manager import KVCacheManager
from ragserve_engine.sequence import Sequence

BS = 4
LAYOUT = KVLayout("unit-test-model", "auto:float32", BS, 1, 1, 8)


def admit(kv: KVCacheManager, tokens: list[int], salt: str | None = None) -> Sequence:
    """Allocate the sequence's blocks (reusing cached ones), mark every token computed, cache its full blocks."""
    seq = Sequence(list(tokens), len(tokens))
    hits = kv.get_computed_blocks(seq, salt)
    assert kv.allocate_slots(seq, len(tokens) - len(hits) * BS, hits)
    seq.num_computed_tokens = len(tokens)
    kv.cache_blocks(seq, salt)
    return seq
