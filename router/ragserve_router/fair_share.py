"""--tenant-fair-share: each active tenant's max-min fair allocation of a model's places, by its recent demand.

A tenant's demand is the most places it held or waited for (its requests admitted plus those queued) lately: the
peak decays by half every DEMAND_HALF_LIFE seconds, and is never below what it holds and waits for now, so a
closed-loop client between two requests (an answer ended, the next not sent yet) still counts. The allocation is
max-min fair (water-filling): tenants asking for less than an even split get what they ask, the rest is split
evenly among the others (the smaller demands get a remainder place first).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field

DEMAND_HALF_LIFE = 1.0  # seconds for a tenant's peak demand to halve once it asks for less


@dataclass
class TenantDemand:
    half_life: float = DEMAND_HALF_LIFE
    peaks: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)  # (model, tenant) -> (peak, at)

    def note(self, model: str, tenant: str, asking: int) -> None:
        """The tenant now holds or waits for `asking` places: a new peak when it is above the decayed one."""
        now = time.monotonic()
        if asking >= self._decayed((model, tenant), now):
            self.peaks[model, tenant] = (float(asking), now)

    def demands(self, model: str, asking: Counter[tuple[str, str]]) -> dict[str, int]:
        """The model's active tenants and their demand (places); tenants whose demand decayed to 0 are forgotten."""
        now, out = time.monotonic(), {}
        for key in [k for k in self.peaks if k[0] == model]:
            demand = max(asking[key], round(self._decayed(key, now)))
            if demand > 0:
                out[key[1]] = demand
            else:
                del self.peaks[key]
        return out

    def _decayed(self, key: tuple[str, str], now: float) -> float:
        peak, at = self.peaks.get(key, (0.0, now))
        return peak * 0.5 ** ((now - at) / self.half_life)


def fair_allocation(demands: dict[str, int], places: int) -> dict[str, int]:
    """Max-min fair split of `places` among tenants asking for `demands` (water-filling, whole places)."""
    alloc, left = {}, places
    order = sorted(demands, key=lambda t: demands[t])
    for i, tenant in enumerate(order):
        alloc[tenant] = min(demands[tenant], math.ceil(left / (len(order) - i)))
        left -= alloc[tenant]
    return alloc
