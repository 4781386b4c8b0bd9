"""Continuous batching of encoder passes: a FIFO of inputs; each step takes the waiting inputs, oldest first, while
the padded batch (inputs x longest input) fits --max-num-batched-tokens and --max-num-seqs. No KV cache, so an
input is done after the one pass that takes it; a step always takes at least one input."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class PoolingSequence:
    request_id: str  # the HTTP request it belongs to (abort drops all of its inputs)
    token_ids: list[int]
    done: Callable[[object, BaseException | None], None]  # done(vector, None) or done(None, error)
    aborted: bool = field(default=False, init=False)


class PoolingScheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[PoolingSequence] = deque()
        self.waiting_tokens = 0

    def add(self, seqs: list[PoolingSequence]) -> None:
        self.waiting.extend(seqs)
        self.waiting_tokens += sum(len(s.token_ids) for s in seqs)

    def abort(self, request_id: str) -> None:
        for seq in self.waiting:
            if seq.request_id == request_id:
                seq.aborted = True

    def schedule(self) -> list[PoolingSequence]:
        """The next step's batch (aborted inputs are dropped on the way)."""
        batch: list[PoolingSequence] = []
        width = 0
        while self.waiting and len(batch) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.aborted:
                self._pop()
                continue
            longest = max(width, len(seq.token_ids))
            if batch and longest * (len(batch) + 1) > self.max_num_batched_tokens:
                break
            batch.append(self._pop())
            width = longest
        return batch

    def _pop(self) -> PoolingSequence:
        seq = self.waiting.popleft()
        self.waiting_tokens -= len(seq.token_ids)
        return seq

    def has_waiting(self) -> bool:
        return bool(self.waiting)
