"""The router queue: flow control by priority class, fair between tenants (virtual token counters, VTC).

With --max-inflight-per-engine N (0: off, nothing ever waits) a model has N x (its candidate engines) places.
A request takes one when it is admitted and gives it back when its answer ends (the engine slot's release). When
none is free it waits in a bounded queue (--queue-size; full: 429 queue_full, or the lowest-ranked waiter makes
room for a higher class) for at most --queue-timeout seconds (then 503 queue_timeout). A sheddable request never
waits: 429 saturated. --critical-reserve-per-engine K keeps K of each engine's places for critical requests:
standard and sheddable ones are admitted only while fewer than (N - K) x engines are taken, so a critical request
finds a place (and, with the engine's max-num-seqs at N, a free seat in its batch) at once.
A freed place goes to the highest class waiting that fits; within a class, to the tenant with the
fewest weighted tokens served (prompt tokens x 1 at admission, completion tokens x 2 when the usage comes back,
as in Sheng et al., "Fairness in Serving Large Language Models"); within a tenant, first come first served.
A tenant with nothing waiting that sends a request is lifted to the least counter of the tenants waiting, or, when
nobody waits, to the counter of the tenant served last (VTC's rule), so neither idle time nor arriving late banks
credit: a tenant that joins while another is served alone does not start thousands of tokens behind it.
With --tenant-fair-share each active tenant has a max-min fair allocation of the model's places by its recent
demand (fair_share.py); a tenant at or over its allocation takes a free place only while more stay free than the
other tenants' allocations lack, each at most one more than it holds and waits for (work-conserving otherwise): a
heavy tenant's admitted requests do not fill the places a light tenant's clients come back for, so its next request
finds one free.
With --engine-priority as well (preempt), fairness does not wait for a heavy tenant's answers to end: a tenant
under its allocation is admitted even when every place is taken, and each request carries its rank, the places its
tenant held when it was admitted (never below a rank it still holds), as its engine priority (priority.py): the
engine (--scheduling-policy priority) preempts the running request of the highest rank, the newest place of the
tenant holding the most, for it. What the router admits past its places is bounded by the allocations and shrinks
as the over-share tenant's answers end.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from ragserve.http.errors import ApiError
from ragserve_router.fair_share import TenantDemand, fair_allocation
from ragserve_router.metrics import RouterMetrics
from ragserve_router.priority import CRITICAL, RANK, SHEDDABLE

PROMPT_WEIGHT, COMPLETION_WEIGHT = 1.0, 2.0
MAX_TENANTS = 10_000  # counters kept; an idle tenant's is forgotten past this (the lift makes that harmless)
RECHECK = 1.0  # seconds between a waiter's own looks at the capacity (engines that joined since)


@dataclass(eq=False)
class Waiter:
    model: str
    cls: str
    tenant: str
    seq: int
    since: float
    admitted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass
class FlowControl:
    per_engine: int  # --max-inflight-per-engine (0: off)
    queue_size: int
    queue_timeout: float
    metrics: RouterMetrics
    engines: Callable[[str], int]  # the model's candidate engines now
    reserve: int = 0  # --critical-reserve-per-engine
    fair_share: bool = False  # --tenant-fair-share
    preempt: bool = False  # --engine-priority with --tenant-fair-share: the engine takes places back (ranks)
    held: Counter[tuple[str, str]] = field(default_factory=Counter)  # (model, tenant) -> places taken
    ranks: dict[tuple[str, str], Counter[int]] = field(default_factory=dict)  # (model, tenant) -> ranks held, counted
    queued: Counter[tuple[str, str]] = field(default_factory=Counter)  # (model, tenant) -> requests waiting
    demand: TenantDemand = field(default_factory=TenantDemand)  # --tenant-fair-share
    counters: dict[str, float] = field(default_factory=dict)  # tenant -> weighted tokens served
    inflight: Counter[str] = field(default_factory=Counter)  # model -> places taken
    waiting: list[Waiter] = field(default_factory=list)
    last: float = 0.0  # the counter of the tenant charged last (where a tenant arriving at an empty queue starts)
    _seq: itertools.count = field(default_factory=itertools.count)

    @property
    def enabled(self) -> bool:
        return self.per_engine > 0

    def per_engine_for(self, cls: str) -> int:
        """The places per engine a class may fill: all for critical, less the reserve for the others."""
        return self.per_engine - (0 if cls == CRITICAL else self.reserve)

    def capacity(self, model: str, cls: str = CRITICAL) -> int:
        return self.per_engine_for(cls) * self.engines(model)

    async def acquire(self, model: str, cls: str, tenant: str) -> int:
        """Return the request's rank (the places its tenant held before it) once it holds a place (at once when one
        is free and nobody waits); raise a 429 or 503."""
        if not self.enabled:
            return 0
        self._lift(tenant)
        self._note(model, tenant, arriving=int(cls != SHEDDABLE))  # a sheddable one reserves nothing it may not get
        self.dispatch(model)  # then no waiter fits: this request goes ahead only if it does
        if self._fits(model, cls, tenant, self._allocations(model)):
            self.metrics.child(self.metrics.queue_wait, cls).observe(0)
            return self._admit(model, tenant)
        if cls == SHEDDABLE:
            self._refuse(cls, "saturated", 429, "every engine is at its in-flight limit and this request is sheddable")
        waiter = self._enqueue(model, cls, tenant)
        try:
            rank = await self._wait(waiter)
        except BaseException:  # timed out, pushed out, or the client left (cancelled)
            self._forget(waiter)
            admitted = waiter.admitted
            if admitted.done() and not admitted.cancelled() and admitted.exception() is None:
                self.release(model, tenant, admitted.result())  # admitted as it was cancelled: the place goes on
            raise
        self.metrics.queue_wait.labels(cls).observe(time.monotonic() - waiter.since)
        return rank

    async def _wait(self, waiter: Waiter) -> int:
        deadline = waiter.since + self.queue_timeout
        while (left := deadline - time.monotonic()) > 0:
            # not wait_for: on Python 3.11 it returns the result when the client leaves (a cancel) just as the place
            # is granted, and the request goes on to take an engine slot that nobody releases
            if (await asyncio.wait({waiter.admitted}, timeout=min(left, RECHECK)))[0]:
                return waiter.admitted.result()
            self.dispatch(waiter.model)
        if waiter.admitted.done():
            return waiter.admitted.result()
        self._forget(waiter)
        self._refuse(waiter.cls, "queue_timeout", 503, f"waited {self.queue_timeout:g} s in the router queue")

    def release(self, model: str, tenant: str, rank: int) -> None:
        """A request's answer ended (`rank`: what acquire returned for it): its place goes to the next waiter."""
        if self.enabled:
            self.inflight[model] = max(0, self.inflight[model] - 1)
            _take_one(self.held, (model, tenant))
            if (ranks := self.ranks.get((model, tenant))) is not None:
                _take_one(ranks, rank)
                if not ranks:
                    del self.ranks[model, tenant]
            self.dispatch(model)

    def charge(self, tenant: str, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        """Tokens served to the tenant (its virtual token counter)."""
        cost = PROMPT_WEIGHT * prompt_tokens + COMPLETION_WEIGHT * completion_tokens
        self.counters[tenant] = self.last = self.counters.get(tenant, 0.0) + cost

    def dispatch(self, model: str) -> None:
        """Admit waiters for the model while it has free places: highest class, then least-served tenant."""
        while True:
            alloc = self._allocations(model)
            ready = [w for w in self.waiting if w.model == model and self._fits(model, w.cls, w.tenant, alloc)]
            if not ready:
                return
            best = min(ready, key=lambda w: (RANK[w.cls], self.counters.get(w.tenant, 0.0), w.seq))
            self._forget(best)
            best.admitted.set_result(self._admit(model, best.tenant))

    def _fits(self, model: str, cls: str, tenant: str, alloc: Callable[[str], dict[str, int]]) -> bool:
        """A free place for the class; with --tenant-fair-share, one that no other tenant's allocation lacks (a tenant
        under its allocation: any free place, or with preempt one past them, that the engine takes back)."""
        free = self.capacity(model, cls) - self.inflight[model]
        if not self.fair_share or (free <= 0 and not self.preempt):
            return free > 0
        shares = alloc(cls)
        if self.held[model, tenant] < shares.get(tenant, 0):
            return True
        if free <= 0:
            return False
        return free > sum(self._owed(model, t, n) for t, n in shares.items() if t != tenant)

    def _owed(self, model: str, tenant: str, share: int) -> int:
        """Free places kept for a tenant under its allocation: what it lacks, but at most one more than it holds
        and waits for (a tenant whose answers all ended, or that left, keeps one free while its demand decays)."""
        asking = self.held[model, tenant] + self.queued[model, tenant]
        return max(0, min(share - self.held[model, tenant], asking + 1))

    def _allocations(self, model: str) -> Callable[[str], dict[str, int]]:
        """The tenants' fair allocation of the places a class may fill (--tenant-fair-share), computed once a class."""
        if not self.fair_share:
            return lambda cls: {}
        demands, by_cls = self.demand.demands(model, self.held + self.queued), {}

        def alloc(cls: str) -> dict[str, int]:
            if cls not in by_cls:
                by_cls[cls] = fair_allocation(demands, self.capacity(model, cls))
            return by_cls[cls]

        return alloc

    def _admit(self, model: str, tenant: str) -> int:
        """Take a place; the request's rank: the places its tenant holds, but never below a rank it still holds (an
        older request of it still running keeps a rank from when it held more; ties: the engine takes the newest)."""
        ranks = self.ranks.setdefault((model, tenant), Counter())
        rank = max(self.held[model, tenant], max(ranks, default=0))
        ranks[rank] += 1
        self.inflight[model] += 1
        self.held[model, tenant] += 1
        self._note(model, tenant)
        return rank

    def _note(self, model: str, tenant: str, arriving: int = 0) -> None:
        if self.fair_share:
            self.demand.note(model, tenant, self.held[model, tenant] + self.queued[model, tenant] + arriving)

    def _enqueue(self, model: str, cls: str, tenant: str) -> Waiter:
        if len(self.waiting) >= self.queue_size:
            self._make_room(cls)
        if len(self.counters) > MAX_TENANTS:
            self._forget_idle()
        waiter = Waiter(model, cls, tenant, next(self._seq), time.monotonic())
        self.waiting.append(waiter)
        self.queued[model, tenant] += 1
        self.metrics.queue_depth.labels(cls).inc()
        return waiter

    def _lift(self, tenant: str) -> None:
        """A tenant with nothing waiting: up to the least counter waiting, or the last served one's (VTC)."""
        if any(w.tenant == tenant for w in self.waiting):
            return
        floor = min((self.counters.get(w.tenant, 0.0) for w in self.waiting), default=self.last)
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    def _make_room(self, cls: str) -> None:
        """Queue full: the newest waiter of the lowest class below `cls` leaves with a 429, else this request."""
        lower = [w for w in self.waiting if RANK[w.cls] > RANK[cls]]
        if not lower:
            self._refuse(cls, "queue_full", 429, f"the router queue is full ({self.queue_size} waiting)")
        victim = max(lower, key=lambda w: (RANK[w.cls], w.seq))
        self._forget(victim)
        self.metrics.shed.labels(victim.cls, "queue_full").inc()
        victim.admitted.set_exception(self._error("queue_full", 429, "made room for a higher-priority request"))

    def _forget(self, waiter: Waiter) -> None:
        if waiter in self.waiting:
            self.waiting.remove(waiter)
            _take_one(self.queued, (waiter.model, waiter.tenant))
            self.metrics.queue_depth.labels(waiter.cls).dec()

    def _forget_idle(self) -> None:
        busy = {w.tenant for w in self.waiting}
        for tenant in [t for t in self.counters if t not in busy]:
            del self.counters[tenant]

    def _refuse(self, cls: str, reason: str, status: int, why: str) -> None:
        self.metrics.shed.labels(cls, reason).inc()
        raise self._error(reason, status, why)

    def _error(self, reason: str, status: int, why: str) -> ApiError:
        retry = str(max(1, math.ceil(min(self.queue_timeout, 5.0))))
        return ApiError(status, f"{why}; try again later", reason, None, {"Retry-After": retry})


def _take_one(counter: Counter, key) -> None:
    """One fewer for the key; a key at zero leaves the counter (tenants come and go)."""
    if (n := counter[key] - 1) > 0:
        counter[key] = n
    else:
        counter.pop(key, None)
