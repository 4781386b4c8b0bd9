"""Disaggregated prefill/decode (docs/disaggregation.md): the prompt's tail block moves too.

A prefill engine (--role prefill) stores, besides the full blocks every cachestore engine offloads, the
block holding the prompt's tail (the tokens after the cacheable full blocks, but the last one:
ragserve.keys.tail_block) under the tail's own key, and waits until the store has everything before the
request's answer leaves. A decode engine (--role decode) fetches the tail with the full blocks and lands it
in the request's first fresh block at admission, so its first step computes the last prompt token only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ragserve.keys import cacheable_blocks, tail_block
from ragserve_engine.kv_cache_manager import KVCacheManager
from ragserve_engine.sequence import Sequence

if TYPE_CHECKING:
    from ragserve_engine.kv_connector import CacheStoreConnector


def prompt_tail(kv_manager: KVCacheManager, seq: Sequence, cache_salt: str | None) -> tuple[int, bytes] | None:
    """(tail tokens, tail key) of the sequence's prompt, None when the prompt has no tail."""
    hashes = kv_manager.update_hashes(seq, cache_salt)
    prompt = seq.token_ids[: seq.num_prompt_tokens]
    return tail_block(prompt, kv_manager.block_size, kv_manager.root, hashes, cache_salt)


def offload_prompts(connector: CacheStoreConnector, kv_manager: KVCacheManager, scheduled: list) -> None:
    """Prefill role, after a step (`scheduled`: its ScheduledSeqs): queue the tail block of every prompt the step
    completed, then wait until the store holds every queued block (so the decode engine finds them once the answer
    is out)."""
    completed = [s for s in scheduled if s.sample and s.seq.num_computed_tokens == s.seq.num_prompt_tokens]
    if not completed:
        return
    for s in completed:
        if (tail := prompt_tail(kv_manager, s.seq, s.request.cache_salt)) is not None:
            block = s.seq.blocks[cacheable_blocks(s.seq.num_prompt_tokens, kv_manager.block_size)]
            connector.offload([(block, tail[1])], scheduled)
    connector.flush()
    connector.stats.transfer_requests["stored"] += len(completed)  # their KV is in the store now


def land_tail(connector: CacheStoreConnector, seq: Sequence, num_hit_blocks: int, tail: tuple[int, bytes]) -> None:
    """Decode role, at admission (slots allocated): the fetched tail KV fills the block after the hits."""
    count, data = tail
    connector.kv_cache.write_block(seq.blocks[num_hit_blocks].block_id, data)
    seq.num_computed_tokens += count
    connector.stats.hits += count
