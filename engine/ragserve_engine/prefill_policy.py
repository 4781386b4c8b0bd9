"""Prefill policy: a request's prefix hit and chunk size, long prefills' turns, prompt blocks shared in flight.

With --long-prefill-token-threshold a prefill takes at most that many tokens a step, and at most
--max-long-partial-prefills prompts longer than it are prefilled at once. With prefix caching a waiting prompt
whose next uncached block a running prefill is computing waits for it (SGLang's in-batch prefix sharing), and
the queued prefill tokens the engine reports count such blocks once.
"""

from __future__ import annotations

from ragserve.engine_args import EngineConfig
from ragserve.keys import cacheable_blocks
from ragserve_engine.kv_cache_manager import KVCacheManager
from ragserve_engine.sequence import Request


def tokens_left(req: Request) -> int:
    """Tokens its sequences (in lockstep) have still to compute: 0 with none live."""
    seqs = req.live_seqs
    return seqs[0].num_tokens - seqs[0].num_computed_tokens if seqs else 0


class PrefillPolicy:
    def __init__(self, config: EngineConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_manager = kv_manager

    def prefix_hits(self, req: Request) -> list[list]:
        seqs = req.live_seqs
        if req.params.prompt_logprobs is not None or req.blend is not None:  # no logits / blended whole
            return [[] for _ in seqs]
        hits = [self.kv_manager.get_computed_blocks(s, req.cache_salt) for s in seqs]
        common = min(len(h) for h in hits)
        return [h[:common] for h in hits]

    def kv_for_first_chunk(self, req: Request, budget: int) -> bool:
        """Free KV blocks for the waiting request's first chunk (past its local prefix hit)."""
        hits = self.prefix_hits(req)
        _, chunk = self.first_chunk(req, hits, budget)
        return self.kv_manager.can_allocate(self.blocks_needed(req, hits, max(1, chunk)), [b for h in hits for b in h])

    def first_chunk(self, req: Request, hits: list[list], budget: int, tail: int = 0) -> tuple[int, int]:
        """A waiting request's prompt tokens left past its hits (and a fetched tail), and its first chunk of them."""
        remaining = req.live_seqs[0].num_tokens - len(hits[0]) * self.kv_manager.block_size - tail
        return remaining, min(remaining, budget // len(req.live_seqs), self._long_prefill_cap(req, remaining))

    def blocks_needed(self, req: Request, hits: list[list], tokens: int) -> int:
        pairs = zip(req.live_seqs, hits, strict=True)
        return sum(self.kv_manager.num_blocks_needed(s, tokens, len(h)) for s, h in pairs)

    def chunk(self, req: Request, budget: int) -> int:
        """A running or swapped request's tokens this step: 0 when it does not fit the budget left."""
        seqs, remaining = req.live_seqs, tokens_left(req)
        if (cap := self._long_prefill_cap(req, remaining)) < remaining:
            return min(cap, budget // len(seqs))
        if remaining * len(seqs) <= budget:
            return remaining
        return budget // len(seqs) if self.config.enable_chunked_prefill else 0

    def _long_prefill_cap(self, req: Request, remaining: int) -> int:
        """--long-prefill-token-threshold (vLLM's): one prefill takes at most that many tokens a step, so a cold
        prompt never holds a whole step's budget and a prompt arriving during it gets its first token a step
        or two later, not after the cold prefill."""
        cap = self.config.prefill_cap
        if not cap or req.blend is not None:
            return remaining
        return cap

    def long_prefill(self, req: Request, remaining: int) -> bool:
        """More prompt tokens left than --long-prefill-token-threshold: a long prefill, in chunks of the cap."""
        return self._long_prefill_cap(req, remaining) < remaining

    def long_prefill_slot(self, req: Request, running: list[Request]) -> bool:
        """--max-long-partial-prefills (vLLM's): a long prompt starts only while fewer long prefills are running
        (of its priority or higher, under --scheduling-policy priority), so a queue of cold prompts gets its first
        tokens one after another instead of all of them late; shorter prompts pass a long one that waits."""
        limit, by_priority = self.config.max_long_partial_prefills, self.config.scheduling_policy == "priority"
        if not limit:
            return True
        num_long = 0
        for r in running:
            num_long += self.long_prefill(r, tokens_left(r)) and (not by_priority or r.priority <= req.priority)
        return num_long < limit

    def _shares_prefix(self, req: Request) -> bool:
        """Its prompt blocks are cached for (and hit by) others: prefix caching, one sequence, not blended."""
        single = len(req.live_seqs) == 1 and req.blend is None and req.params.prompt_logprobs is None
        return self.config.enable_prefix_caching and single

    def uncomputed_blocks(self, req: Request) -> list[bytes]:
        seq, bs = req.live_seqs[0] if self._shares_prefix(req) else None, self.kv_manager.block_size
        if seq is None or seq.num_computed_tokens >= seq.num_prompt_tokens:
            return []
        return seq.block_hashes[seq.num_computed_tokens // bs : seq.num_prompt_tokens // bs]

    def blocks_in_prefill(self, running: list[Request]) -> set[bytes]:
        """Prompt blocks running requests are still prefilling: cached for everyone once computed."""
        return {h for req in running for h in self.uncomputed_blocks(req)}

    def next_block_in_prefill(self, req: Request, num_hits: int, computing: set[bytes]) -> bool:
        """SGLang's in-batch prefix sharing: a waiting prompt whose next uncached block a running prefill is
        computing waits for it instead of computing the same tokens next to it."""
        if not computing or not self._shares_prefix(req):
            return False
        seq = req.live_seqs[0]
        cacheable = cacheable_blocks(seq.num_tokens, self.kv_manager.block_size)
        return num_hits < cacheable and seq.block_hashes[num_hits] in computing

    def queued_prefill_tokens(self, running: list[Request], queued: list[Request]) -> int:
        """Prompt tokens still to compute: partial prefills, and queued requests (waiting or fetching) past their
        local prefix hit and past blocks a prefill ahead of them computes (counted once)."""
        total, bs = 0, self.kv_manager.block_size
        for req in running:
            remaining = tokens_left(req)
            total += remaining if remaining > 1 else 0
        computing = self.blocks_in_prefill(running)
        for req in queued:
            seqs = req.live_seqs
            if not seqs:
                continue
            hashes, hit = seqs[0].block_hashes, len(self.prefix_hits(req)[0])
            cacheable = cacheable_blocks(seqs[0].num_tokens, bs)
            while self._shares_prefix(req) and hit < cacheable and hashes[hit] in computing:
                hit += 1
            if self._shares_prefix(req):
                computing.update(hashes[hit : seqs[0].num_prompt_tokens // bs])
            total += seqs[0].num_tokens - max(hit * bs, seqs[0].num_computed_tokens)
        return total
