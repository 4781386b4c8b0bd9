"""Admission of one request, for both front ends: its tenant's quota (quotas.py), then a place in the router
queue (flow.py). The Claim it returns is settled with the answer's usage and released with the engine slot."""

from __future__ import annotations

from dataclasses import dataclass, field

from ragserve_router.flow import FlowControl
from ragserve_router.quotas import Quotas


@dataclass
class Gate:
    quotas: Quotas
    flow: FlowControl

    async def enter(self, model: str, cls: str, tenant: str, prompt_tokens: int) -> Claim:
        """Wait for the request's turn; a 429 or 503 ApiError when over quota, shed or timed out in the queue."""
        headers = self.quotas.enter(tenant, prompt_tokens)
        try:
            rank = await self.flow.acquire(model, cls, tenant)
        except BaseException:
            self.quotas.settle(tenant, -prompt_tokens)  # never served: its tokens go back
            self.quotas.leave(tenant)
            raise
        self.flow.charge(tenant, prompt_tokens=prompt_tokens)
        return Claim(self, model, tenant, prompt_tokens, headers, rank)


@dataclass
class Claim:
    """What an admitted request holds: a queue place, a concurrent place and the prompt tokens charged."""

    gate: Gate
    model: str
    tenant: str
    charged: int  # prompt tokens charged at admission (the router's count; the engine's usage corrects it)
    headers: dict[str, str] = field(default_factory=dict)  # x-ratelimit-* for the answer
    rank: int = 0  # places its tenant held when it was admitted (flow.py)
    held: bool = True
    settled: bool = False

    def settle(self, usage: dict | None) -> None:
        """The answer's usage: the prompt tokens' difference and the completion tokens, to the quota and VTC."""
        if self.settled or not isinstance(usage, dict):
            return
        self.settled = True
        prompt = usage.get("prompt_tokens")
        extra = prompt - self.charged if isinstance(prompt, int) else 0
        completion = usage.get("completion_tokens")
        completion = completion if isinstance(completion, int) else 0
        self.gate.quotas.settle(self.tenant, extra + completion)
        self.gate.flow.charge(self.tenant, prompt_tokens=extra, completion_tokens=completion)

    def release(self) -> None:
        """The request is over (its engine slot released): its places go back, once."""
        if self.held:
            self.held = False
            self.gate.quotas.leave(self.tenant)
            self.gate.flow.release(self.model, self.tenant, self.rank)
