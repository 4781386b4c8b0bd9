"""A circuit breaker per engine, separate from its health: --breaker-failures failures in a row (engine-side 5xx,
refused or timed-out connections, broken streams) open it; while open the engine is no candidate. After
--breaker-cooldown seconds it is half-open: --breaker-probes requests go through as probes; a probe that succeeds
closes it, one that fails opens it again for another cooldown. Health (probes of /health) is the pool's own:
an engine whose /health answers but whose completions fail stays healthy and is kept out by its breaker."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

CLOSED, HALF_OPEN, OPEN = "closed", "half_open", "open"
STATES = (CLOSED, HALF_OPEN, OPEN)
STATE_VALUE = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}  # the ragserve_router_breaker_state gauge


@dataclass
class Breaker:
    failures_to_open: int
    cooldown: float
    probes: int = 1  # requests let through while half-open
    clock: Callable[[], float] = time.monotonic
    on_change: Callable[[str], None] = lambda state: None
    state: str = CLOSED
    failures: int = 0  # consecutive
    opened_at: float = 0.0
    probing: int = 0  # probes sent while half-open, without an outcome yet

    def allows(self) -> bool:
        """May a request be sent to the engine now (an open breaker whose cooldown is over turns half-open)."""
        if self.state == OPEN and self.clock() - self.opened_at >= self.cooldown:
            self._to(HALF_OPEN)
        return self.state == CLOSED or (self.state == HALF_OPEN and self.probing < self.probes)

    def retry_after(self) -> float:
        """Seconds until an open breaker lets a probe through (0 when not open)."""
        return max(0.0, self.cooldown - (self.clock() - self.opened_at)) if self.state == OPEN else 0.0

    def sent(self) -> None:
        """A request went to the engine: while half-open it is a probe."""
        if self.state == HALF_OPEN:
            self.probing += 1

    def success(self) -> None:
        self.failures = 0
        if self.state != CLOSED:
            self._to(CLOSED)

    def failure(self) -> None:
        self.failures += 1
        if self.state == HALF_OPEN or (self.state == CLOSED and self.failures >= self.failures_to_open):
            self.opened_at = self.clock()
            self._to(OPEN)

    def _to(self, state: str) -> None:
        self.state, self.probing = state, 0
        self.on_change(state)
