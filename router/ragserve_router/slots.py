"""This replica's own record of the requests it sent each engine (pool.py's health view).

A Slot is one request's reservation on an engine: its in-flight count, the prompt tokens the engine must
compute for it until its first token (Prefill), and its prompt's block hashes, send time and KV demand until
it ends, which the cost model reads where the engine's heartbeat and KV events lag (pool.queued_prefill,
routed_blocks, held_blocks, pending_blocks).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from ragserve_router.breaker import Breaker
from ragserve_router.engines import EngineRecord
from ragserve_router.metrics import RouterMetrics


@dataclass(frozen=True)
class Prefill:
    """A prompt this replica sent an engine that has not produced its first token yet."""

    at: float  # wall clock when sent
    tokens: int  # prompt tokens the engine must compute for it
    hashes: tuple[bytes, ...] = ()  # its prompt's block hashes: blocks the engine will hold soon
    output: int = 0  # tokens it may generate (its max_tokens): KV blocks it will take beside its prompt's
    fetched: int = 0  # prompt tokens it loads from the cachestore: no prefill work, but blocks all the same

    def blocks(self, block_tokens: int) -> int:
        """KV blocks it takes anew: its prompt tokens to compute or fetch (past what the engine or a prompt we
        sent before it holds) and its output."""
        return -(-(self.tokens + self.fetched + self.output) // block_tokens)


@dataclass
class Health:
    inflight: int = 0
    healthy: bool = True
    streak: int = 0  # health probes passed (> 0) or failed (< 0) in a row (health.judge)
    left_at: deque[float] = field(default_factory=lambda: deque(maxlen=256))  # when our requests left the engine
    prefills: dict[int, Prefill] = field(default_factory=dict)  # our requests there without a first token yet
    prompts: dict[int, Prefill] = field(default_factory=dict)  # our requests there as sent, joined in time order
    # (sent, done, tokens) of our prompts whose prefill ended there (first token, or the request left), in time order
    prefilled: deque[tuple[float, float, int]] = field(default_factory=lambda: deque(maxlen=256))

    def left_since(self, t: float) -> int:
        count = 0
        for at in reversed(self.left_at):  # appended in time order: stop at the first one before t
            if at <= t:
                break
            count += 1
        return count

    def prefill_done(self, key: int) -> None:
        """Our prompt `key` no longer waits for its prefill there (its first token came, or it left)."""
        if (prefill := self.prefills.pop(key, None)) is not None:
            self.prefilled.append((prefill.at, time.time(), prefill.tokens))

    def prefilled_since(self, sent_by: float, done_after: float) -> int:
        """Prompt tokens of ours sent by `sent_by` whose prefill ended after `done_after`: a report taken at
        `done_after` that arrived at `sent_by` counted them as queued, and they are not any more."""
        tokens = 0
        for sent, done, n in reversed(self.prefilled):
            if done <= done_after:
                break
            tokens += n if sent <= sent_by else 0
        return tokens

    def blocks_sent_since(self, t: float, block_tokens: int) -> int:
        """KV blocks our requests there sent after `t` (a heartbeat's arrival, whose free count lacks them) take."""
        blocks = 0
        for sent in reversed(self.prompts.values()):  # joined in time order: stop at the first one sent by t
            if sent.at <= t:
                break
            blocks += sent.blocks(block_tokens)
        return blocks


class Owner(Protocol):
    """What a slot updates: the pool's per-engine health and breakers (pool.EnginePool)."""

    health: dict[str, Health]
    metrics: RouterMetrics

    def breaker(self, engine_id: str) -> Breaker: ...


class Slot:
    """One request's reservation on an engine's in-flight count; moved on retries, released exactly once.

    Until the first token arrives it also holds the prompt tokens the engine must compute for it and the
    prompt's block hashes: an engine admits new requests only between steps and reports its queue and
    its KV events after one, so for a step's duration (seconds, on a CPU) neither its heartbeat nor the
    KV index can show what was just sent there."""

    def __init__(
        self,
        pool: Owner,
        engine: EngineRecord,
        prefill_tokens: int = 0,
        hashes: Sequence[bytes] = (),
        on_release: Callable[[], None] | None = None,
        output_tokens: int = 0,
        fetched_tokens: int = 0,
    ) -> None:
        self.pool, self.engine, self.held, self.on_release = pool, engine, True, on_release
        self.sent = Prefill(time.time(), prefill_tokens, tuple(hashes), output_tokens, fetched_tokens)
        self.prefilling = True  # no first token yet
        pool.metrics.inflight.inc()
        self._join()

    def move(self, engine: EngineRecord) -> None:
        self._leave()
        self.engine = engine
        self.sent = replace(self.sent, at=time.time())  # a retry: sent now, to the new engine
        self._join()

    def first_token(self) -> None:
        """The engine finished this prompt's prefill."""
        if self.held and self.prefilling:
            if (health := self.pool.health.get(self.engine.engine_id)) is not None:
                health.prefill_done(id(self))
            self.prefilling = False

    def release(self) -> None:
        if self.held:
            self._leave()
            self.held = False
            self.pool.metrics.inflight.dec()
            if self.on_release is not None:
                self.on_release()

    def _join(self) -> None:
        health = self.pool.health[self.engine.engine_id]
        health.inflight += 1
        self.pool.breaker(self.engine.engine_id).sent()
        health.prompts[id(self)] = self.sent
        if self.prefilling:
            health.prefills[id(self)] = self.sent

    def _leave(self) -> None:
        health = self.pool.health.get(self.engine.engine_id)
        if health is not None:
            health.inflight = max(0, health.inflight - 1)
            health.left_at.append(time.time())
            health.prefill_done(id(self))
            health.prompts.pop(id(self), None)


def leading_match(hashes: Sequence[bytes], prompts: Iterable[tuple[bytes, ...]]) -> int:
    """The most leading blocks `hashes` shares with one of `prompts`."""
    key = tuple(hashes)
    return max((common_prefix(key, other) for other in prompts), default=0)


def common_prefix(a: tuple[bytes, ...], b: tuple[bytes, ...]) -> int:
    """Leading items equal in two tuples: slices compared in C (a shared hash object compares by identity), halving
    the stretch that differs; O(log n) steps in Python instead of one per block."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo]; the first difference is before hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
