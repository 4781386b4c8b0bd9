"""Disaggregated prefill/decode (docs/disaggregation.md): the prompt's tail block moves too.

A prefill engine (--role prefill) stores, besides the full blocks every cachestore engine offloads, the
block holding the prompt's tail (the tokens after the cacheable full blocks, the last one included:
ragserve.keys.tail_block) under the tail's own key, and holds the request's answer until the store has
every block of its prompt (SavingOutputs), while the step loop runs on for the other requests. A decode
engine (--role decode) fetches the tail with the full blocks and lands it in the request's first fresh
block at admission: given the prefill engine's first token it computes no prompt token, else only the last.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ragserve.keys import cacheable_blocks, tail_block
from ragserve_engine.kv_cache_manager import KVCacheManager
from ragserve_engine.outputs import RequestOutput
from ragserve_engine.sequence import Sequence

if TYPE_CHECKING:
    from ragserve_engine.kv_connector import CacheStoreConnector


def prompt_tail(kv_manager: KVCacheManager, seq: Sequence, cache_salt: str | None) -> tuple[int, bytes] | None:
    """(tail tokens, tail key) of the sequence's prompt; None when the sequence needs no tail: its cacheable full
    blocks cover the tail's block already (the prompt ends on a block boundary and the sequence carries its first
    output token, so that block is a full block of it, fetched by its hash)."""
    hashes = kv_manager.update_hashes(seq, cache_salt)
    prompt = seq.token_ids[: seq.num_prompt_tokens]
    bs = kv_manager.block_size
    if cacheable_blocks(len(prompt), bs) < cacheable_blocks(seq.num_tokens, bs):
        return None
    return tail_block(prompt, bs, kv_manager.root, hashes, cache_salt)


@dataclass
class SavingOutputs:
    """Prefill role: a completed prompt's answer leaves once the store has its blocks (vLLM's `finished_sending`,
    turned around: there the blocks wait for their transfer, here the answer does), so the decode engine finds them,
    and the step loop never waits for a put: the other requests' outputs leave as they come."""

    connector: CacheStoreConnector
    marks: dict[str, int] = field(default_factory=dict)  # request id -> the offload mark its answer waits for
    keys: dict[str, list[bytes]] = field(default_factory=dict)  # request id -> its prompt's blocks (full and tail)
    held: dict[str, list[RequestOutput]] = field(default_factory=dict)  # their outputs meanwhile, in order

    def __bool__(self) -> bool:
        return bool(self.marks)

    def offload(self, kv_manager: KVCacheManager, scheduled: list) -> None:
        """After a step (`scheduled`: its ScheduledSeqs): queue the tail block of every prompt the step completed and
        hold its answer until the offload mark (connector.save_mark) past which every block of its prompt was put
        (its full blocks were queued in this step or before)."""
        completed = [s for s in scheduled if s.sample and s.seq.num_computed_tokens == s.seq.num_prompt_tokens]
        for s in completed:
            tail = prompt_tail(kv_manager, s.seq, s.request.cache_salt)
            prompt, bs = s.seq.num_prompt_tokens, kv_manager.block_size
            if tail is not None:
                self.connector.offload([(s.seq.blocks[cacheable_blocks(prompt, bs)], tail[1])], scheduled)
            # every full block (the last prompt block too: a decode engine given the first token fetches it by
            # its hash) and the tail
            self.keys[s.request.request_id] = s.seq.block_hashes[: prompt // bs] + ([tail[1]] if tail else [])
        mark = self.connector.save_mark()
        self.marks.update((s.request.request_id, mark) for s in completed)

    def hold(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The outputs that may leave now (released first: those whose blocks were stored since the last call);
        the rest wait for their blocks."""
        ready = self.finished_saving()
        for out in outputs:
            if out.request_id in self.marks:
                self.held.setdefault(out.request_id, []).append(out)
            else:
                ready.append(out)
        return ready

    def finished_saving(self) -> list[RequestOutput]:
        done = [rid for rid, mark in self.marks.items() if self.connector.saved(mark)]
        for rid in done:
            del self.marks[rid]
            # its KV is in the store now, unless the store did not take some of it (down, backing off, full queue)
            self.connector.stats.transfer_requests["stored"] += self.connector.stored(self.keys.pop(rid))
        return [out for rid in done for out in self.held.pop(rid, [])]

    def wait(self, timeout: float) -> None:
        """Nothing to step: sleep until the oldest held answer's blocks are stored (at most `timeout`)."""
        if self.marks:
            self.connector.wait_saved(min(self.marks.values()), timeout)

    def abort(self, request_id: str) -> None:
        self.marks.pop(request_id, None)
        self.keys.pop(request_id, None)
        self.held.pop(request_id, None)


def land_tail(connector: CacheStoreConnector, seq: Sequence, num_hit_blocks: int, tail: bytes, count: int) -> None:
    """Decode role, at admission (slots allocated): the fetched tail KV fills the block after the hits; `count` of
    its tokens are taken as computed (RemoteFetches.tail)."""
    connector.kv_cache.write_block(seq.blocks[num_hit_blocks].block_id, tail)
    seq.num_computed_tokens += count
    connector.stats.hits += count
