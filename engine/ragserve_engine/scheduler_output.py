"""SchedulerOutput: what one step computes (each sequence's new tokens) and the KV block moves before it."""

from __future__ import annotations

from dataclasses import dataclass, field

from ragserve_engine.sequence import Request, Sequence


@dataclass
class ScheduledSeq:
    request: Request
    seq: Sequence
    num_new_tokens: int
    sample: bool = False  # the chunk reaches the end of the sequence: sample its last logits

    def __post_init__(self) -> None:
        self.sample = self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    num_preempted: int = 0
    newly_cached: list = field(default_factory=list)  # (block, hash) registered after this step

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)
