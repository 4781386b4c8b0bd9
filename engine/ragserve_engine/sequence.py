"""Sequences and the requests that own them (one, or several after an n > 1 / beam-search fork)."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

import torch

from ragserve_engine.blend.spec import BlendSpec
from ragserve_engine.block_pool import KVCacheBlock
from ragserve_engine.detokenizer import DetokState
from ragserve_engine.sampling_params import SamplingParams

_seq_ids = itertools.count()


class Status(Enum):
    WAITING = auto()
    WAITING_FOR_REMOTE_KVS = auto()  # its prefix is being fetched from the cachestore (vLLM's name)
    RUNNING = auto()
    SWAPPED = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Sequence:
    token_ids: list[int]
    num_prompt_tokens: int
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    blocks: list[KVCacheBlock] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chain over full blocks of token_ids
    num_computed_tokens: int = 0
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    output_text: str = ""
    detok: DetokState = field(default_factory=DetokState)  # incremental output text (stop.py)
    generator: torch.Generator | None = None
    index: int = 0  # position in the request's outputs
    swapped_table: list[int] = field(default_factory=list)  # host slots while swapped out
    matcher: Any = None  # guided decoding: the grammar state after token_ids (an llguidance.LLMatcher)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def block_table(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def fork(self) -> Sequence:
        """A copy sharing nothing mutable; the caller shares the KV blocks (ref counts)."""
        child = Sequence(list(self.token_ids), self.num_prompt_tokens)
        child.blocks = list(self.blocks)
        child.block_hashes = list(self.block_hashes)
        child.num_computed_tokens = self.num_computed_tokens
        child.cumulative_logprob = self.cumulative_logprob
        child.logprobs = list(self.logprobs)
        child.output_text, child.detok = self.output_text, self.detok.copy()
        if self.matcher is not None:
            child.matcher = self.matcher.deep_copy()
        if self.generator is not None:
            child.generator = torch.Generator().set_state(self.generator.get_state())
        return child


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    priority: int = 0
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: Status = Status.WAITING
    num_cached_tokens: int = -1  # prefix-cache hit at first admission, in tokens
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    beam_finished: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    needs_fork: bool = False  # n > 1 or beam search: fork once the prompt is prefilled
    external_checked: bool = False  # the cachestore was asked for this request's prefix
    external_blocks: int = 0  # prompt blocks held (local or fetched) after that: fewer later means evicted
    num_resumed_tokens: int = 0  # output tokens given with the request (migration): not output, not counted
    resumed_text: str = ""  # their text, without a trailing incomplete character (the start of the output text)
    blend: BlendSpec | None = None  # chunks marked by the client: a blended prefill (blend/)

    @property
    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.finished]

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED
