"""The step time of an engine's first decode steps, as a histogram (ragserve:warmup_decode_step_seconds): a
decode step that waited for a compile, ran eager beside one, or ran a graph before inductor's first call
warmed it shows as the slow tail, which the steady state's histogram would bury (bench/cold_start.py)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

WARMUP_STEPS = 1000  # decode steps counted, from the engine's first (start-up calibration's included)
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)  # seconds; then +Inf


@dataclass
class WarmupSteps:
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))  # per bucket, not cumulative
    total_seconds: float = 0.0

    @property
    def num_steps(self) -> int:
        return sum(self.counts)

    def observe(self, seconds: float) -> None:
        if self.num_steps < WARMUP_STEPS:
            self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
            self.total_seconds += seconds

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus buckets: (upper bound, steps at or under it), +Inf last."""
        bounds = [str(b) for b in BUCKETS] + ["+Inf"]
        running, out = 0, []
        for bound, count in zip(bounds, self.counts, strict=True):
            running += count
            out.append((bound, running))
        return out
