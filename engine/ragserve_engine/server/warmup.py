"""Knowledge warm-up: prefill texts or chat-message prefixes into the prefix cache, optionally pinned.

A pinned warm-up holds a reference on its cached blocks, so eviction skips them until
`DELETE /v1/warmup/{id}` drops the references.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ragserve.http.errors import ApiError
from ragserve_engine.engine_client import SamplingParams
from ragserve_engine.server.protocol import WarmupRequest

if TYPE_CHECKING:
    from ragserve_engine.engine_client import KVCacheBlocks

MAX_PINNED_FRACTION = 0.5  # pinning more would starve requests of KV blocks


@dataclass
class Warmup:
    warmup_id: str
    pinned: list[KVCacheBlocks] = field(default_factory=list)  # one per prompt

    @property
    def num_blocks(self) -> int:
        return sum(p.num_blocks for p in self.pinned)


class WarmupManager:
    def __init__(self, server) -> None:
        self.server = server
        self.pinned: dict[str, Warmup] = {}

    @property
    def num_pinned_blocks(self) -> int:
        return sum(w.num_blocks for w in self.pinned.values())

    def _prompts(self, req: WarmupRequest) -> list[list[int]]:
        tokenizer = self.server.llm.tokenizer
        if req.texts:
            return [tokenizer.encode(text) for text in req.texts]
        # prefixes of later chats: no generation prompt, so a request that adds messages extends them
        return [tokenizer.encode_chat([m.render_dict() for m in msgs], False) for msgs in req.messages]

    async def warm(self, req: WarmupRequest) -> dict:
        llm = self.server.llm
        max_model_len, num_blocks = llm.info.max_model_len, llm.info.num_blocks
        try:
            prompts = self._prompts(req)
        except ValueError as exc:
            raise ApiError(400, str(exc), "invalid_value", "messages" if req.messages else "texts") from None
        for i, p in enumerate(prompts):
            if not p or len(p) >= max_model_len:
                raise ApiError(
                    400, f"warm-up prompt {i} has {len(p)} tokens; it must have 1 to {max_model_len - 1}",
                    "invalid_value",
                )  # fmt: skip
        hashes = [llm.hash_blocks(p, req.cache_salt) for p in prompts]
        limit = int(num_blocks * MAX_PINNED_FRACTION)
        wanted = sum(len(h) for h in hashes)
        if req.pin and self.num_pinned_blocks + wanted > limit:
            raise ApiError(
                400,
                f"pinning {wanted} more blocks would pin {self.num_pinned_blocks + wanted} of "
                f"{num_blocks} KV blocks; at most {limit} may be pinned",
                "too_many_pinned_blocks",
                "pin",
            )
        warmup_id = f"warmup-{uuid.uuid4().hex}"
        cached = await asyncio.gather(*(self._prefill(warmup_id, i, p, req.cache_salt) for i, p in enumerate(prompts)))
        pinned: list[KVCacheBlocks] = []
        if req.pin:
            pinned = await llm.pin_prefixes(hashes)
            self.pinned[warmup_id] = Warmup(warmup_id, pinned)
        items = [
            {
                "num_tokens": len(p),
                "num_blocks": len(h),
                "num_cached_tokens": c,
                "num_pinned_blocks": pinned[i].num_blocks if req.pin else 0,
                "block_hashes": [x.hex() for x in h],
            }
            for i, (p, h, c) in enumerate(zip(prompts, hashes, cached, strict=True))
        ]
        return {"id": warmup_id, "object": "warmup", "pinned": req.pin, "items": items}

    async def _prefill(self, warmup_id: str, i: int, prompt: list[int], cache_salt: str | None) -> int:
        """Prefill one prompt (one token is sampled and discarded); returns the tokens that were already cached."""
        params = SamplingParams(max_tokens=1, temperature=0.0)
        last = None
        try:
            async for out in self.server.llm.generate(prompt, params, f"{warmup_id}-{i}", cache_salt=cache_salt):
                last = out
        except ValueError as exc:
            raise ApiError(400, f"warm-up prompt {i}: {exc}", "invalid_value") from None
        return last.num_cached_tokens if last else 0

    async def release(self, warmup_id: str) -> dict:
        warmup = self.pinned.pop(warmup_id, None)
        if warmup is None:
            raise ApiError(404, f"no pinned warm-up with id {warmup_id!r}", "not_found", "id")
        await self.server.llm.unpin(warmup.pinned)
        return {"id": warmup_id, "object": "warmup.deleted", "deleted": True, "num_unpinned_blocks": warmup.num_blocks}

    def summary(self) -> dict:
        data = [{"id": w.warmup_id, "num_pinned_blocks": w.num_blocks} for w in self.pinned.values()]
        return {"object": "list", "data": data}
