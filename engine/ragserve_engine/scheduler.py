"""Scheduler: continuous batching with chunked prefill, prefix hits, preemption by recompute or swap.

Each step spends `max_num_batched_tokens` over running requests first, then swapped, then
waiting ones. A request's live sequences (several after an n > 1 or beam fork) move in
lockstep: they are scheduled, preempted and resumed together with equal chunk sizes.
With a cachestore, a request whose prefix is being fetched waits in WAITING_FOR_REMOTE_KVS
(`remote`, remote_fetches.py) while the others keep stepping; it returns to `waiting` when the fetch is done or
its deadline passed (then it recomputes the rest) and the fetched blocks have free KV blocks to land in.
Under --scheduling-policy priority a waiting request of higher priority than a running one is admitted at once:
the lowest-priority running requests are preempted for its seat and KV blocks (as vLLM's priority policy does),
and when it outranks every running request its first chunk runs in a step of its own priority only, so it is
not slowed by a full batch of lower-priority work (those requests skip that one step).
How many tokens each request computes, and which waiting prompts wait their turn: prefill_policy.py.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ragserve.engine_args import EngineConfig
from ragserve_engine.kv_cache_manager import KVCacheManager
from ragserve_engine.prefill_policy import PrefillPolicy
from ragserve_engine.remote_fetches import RemoteFetches
from ragserve_engine.scheduler_output import ScheduledSeq, SchedulerOutput
from ragserve_engine.sequence import Request, Status

if TYPE_CHECKING:
    from ragserve_engine.kv_connector import CacheStoreConnector


class Scheduler:
    def __init__(
        self, config: EngineConfig, kv_manager: KVCacheManager, connector: CacheStoreConnector | None = None
    ) -> None:
        self.config = config
        self.kv_manager = kv_manager
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.remote = RemoteFetches(config, kv_manager, connector)  # WAITING_FOR_REMOTE_KVS
        self.prefill = PrefillPolicy(config, kv_manager)
        self.num_preemptions = 0

    def _key(self, req: Request):
        if self.config.scheduling_policy == "priority":
            return (req.priority, req.arrival_time)
        return (req.arrival_time,)

    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)
        self.waiting.sort(key=self._key)

    @property
    def num_running_seqs(self) -> int:
        return sum(len(r.live_seqs) for r in self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.remote)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.remote:
            self._poll_remote()
        budget = self.config.max_num_batched_tokens
        if self._schedule_urgent(out, budget):
            out.copies = self.kv_manager.take_pending_copies()
            return out
        preempted = out.num_preempted  # for the urgent request, not for lack of KV below
        budget = self._schedule_running(out, budget)
        if out.num_preempted == preempted:
            budget = self._schedule_swapped(out, budget)
        if out.num_preempted == preempted and not self.swapped:
            self._schedule_waiting(out, budget)
        out.copies = self.kv_manager.take_pending_copies()
        return out

    def _schedule_urgent(self, out: SchedulerOutput, budget: int) -> bool:
        """--scheduling-policy priority, a waiting request above a running one's priority: preempt the lowest-priority
        running requests for its seat and blocks; when it then outranks every running one, schedule the waiting
        requests of its priority or higher alone this step. True when that step scheduled something."""
        if self.config.scheduling_policy != "priority" or not self.waiting or not self.running:
            return False
        head = self.waiting[0]
        if head.priority >= max(r.priority for r in self.running):
            return False
        seats = self.config.max_num_seqs - len(head.live_seqs)  # the most running sequences that leave it a seat
        while self.num_running_seqs > seats or not self.prefill.kv_for_first_chunk(head, budget):
            victim = max(self.running, key=self._key)
            if victim.priority <= head.priority:
                break
            self.running.remove(victim)
            self._preempt(victim, out)
            if not self.running:
                break
        if any(r.priority <= head.priority for r in self.running):
            return False
        self._schedule_waiting(out, budget, up_to=head.priority)
        return bool(out.scheduled)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        self.running.sort(key=self._key)
        queue, kept = list(self.running), []
        while queue and budget > 0:
            req = queue.pop(0)
            chunk = self.prefill.chunk(req, budget)
            if chunk == 0:
                queue.insert(0, req)
                break
            while not self._allocate(req, chunk):
                victim = queue.pop() if queue else req
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                kept.append(req)
                budget -= self._emit(out, req, chunk)
        self.running = kept + queue
        return budget

    def _allocate(self, req: Request, chunk: int) -> bool:
        seqs = req.live_seqs
        needed = sum(self.kv_manager.num_blocks_needed(s, chunk) for s in seqs)
        if not self.kv_manager.can_allocate(needed):
            return False
        for seq in seqs:
            if self.kv_manager.allocate_slots(seq, chunk) is None:
                raise RuntimeError("KV allocation failed after the capacity check")
        return True

    def _emit(self, out: SchedulerOutput, req: Request, chunk: int) -> int:
        for seq in req.live_seqs:
            out.scheduled.append(ScheduledSeq(req, seq, chunk))
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        return chunk * len(req.live_seqs)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.num_preemptions += 1
        req.num_preemptions += 1
        out.num_preempted += 1
        if self.config.preemption_mode == "swap":
            mapping = self.kv_manager.swap_out(req.live_seqs)
            if mapping is not None:
                out.swap_out += mapping
                req.status = Status.SWAPPED
                self.swapped.append(req)
                return
        for seq in req.live_seqs:  # recompute: drop the KV, keep the tokens
            self.kv_manager.free(seq)
            seq.num_computed_tokens = 0
        req.status = Status.WAITING
        self.waiting.append(req)
        self.waiting.sort(key=self._key)

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        self.swapped.sort(key=self._key)
        while self.swapped and budget > 0:
            req = self.swapped[0]
            seqs = req.live_seqs
            if self.num_running_seqs + len(seqs) > self.config.max_num_seqs:
                break
            chunk = self.prefill.chunk(req, budget)
            if chunk == 0 or not self.kv_manager.can_swap_in(seqs, chunk):
                break
            self.swapped.pop(0)
            out.swap_in += self.kv_manager.swap_in(seqs)
            req.status = Status.RUNNING
            self._allocate(req, chunk)
            self.running.append(req)
            budget -= self._emit(out, req, chunk)
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, up_to: int | None = None) -> None:
        computing = self.prefill.blocks_in_prefill(self.running)
        deferred: list[Request] = []
        while self.waiting and budget > 0:
            req = self.waiting[0]
            seqs = req.live_seqs
            if up_to is not None and req.priority > up_to:  # an urgent step: its priority or higher only
                break
            if self.num_running_seqs + len(seqs) > self.config.max_num_seqs:
                break
            hits = self.prefill.prefix_hits(req)
            fetched = self.remote.start(req, len(hits[0]), bool(self.running))
            if fetched is None:  # now waiting for remote KVs
                self.waiting.remove(req)
                req.status = Status.WAITING_FOR_REMOTE_KVS
                continue
            if fetched:
                hits = self.prefill.prefix_hits(req)
            if self.prefill.next_block_in_prefill(req, len(hits[0]), computing):
                deferred.append(self.waiting.pop(0))  # a running prefill is computing its next blocks: reuse them
                continue
            tail = self.remote.tail(req, len(hits[0]))
            remaining, chunk = self.prefill.first_chunk(req, hits, budget, tail)
            if self.prefill.long_prefill(req, remaining) and not self.prefill.long_prefill_slot(req, self.running):
                deferred.append(self.waiting.pop(0))  # a long prefill's turn: shorter prompts behind may go
                continue
            if chunk < remaining and not self.config.enable_chunked_prefill or chunk <= 0:
                break
            if req.blend is not None and chunk < remaining:  # a blended prefill runs whole (blend/)
                if remaining <= self.config.max_num_batched_tokens:
                    break
                req.blend = None  # too long for one step: an exact chunked prefill instead
            needed = self.prefill.blocks_needed(req, hits, chunk + tail)
            if not self.kv_manager.can_allocate(needed, [b for h in hits for b in h]):
                break
            self.waiting.pop(0)
            for seq, seq_hits in zip(seqs, hits, strict=True):
                self.kv_manager.allocate_slots(seq, chunk + tail, seq_hits)
            if tail:
                self.remote.land_tail(req, len(hits[0]), tail)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = len(hits[0]) * self.kv_manager.block_size + tail  # a fetched tail too
                self.kv_manager.record_query(seqs[0].num_tokens, req.num_cached_tokens)
            req.status = Status.RUNNING
            self.running.append(req)
            budget -= self._emit(out, req, chunk)
            computing.update(self.prefill.uncomputed_blocks(req))
        self.waiting[:0] = deferred  # they keep their place in line

    def _poll_remote(self) -> None:
        for req in self.remote.poll(bool(self.running)):
            req.status = Status.WAITING
            self.waiting.append(req)
        self.waiting.sort(key=self._key)

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens still to compute, for the load the engine reports (PrefillPolicy.queued_prefill_tokens)."""
        return self.prefill.queued_prefill_tokens(self.running, [*self.waiting, *self.remote])

    def update_after_step(self, out: SchedulerOutput) -> None:
        """The step computed the scheduled tokens: advance and publish full blocks."""
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            out.newly_cached += self.kv_manager.cache_blocks(s.seq, s.request.cache_salt)

    def finish(self, req: Request) -> None:
        self.remote.drop(req)
        self.kv_manager.free_seqs(req.seqs)
        for queue in (self.waiting, self.running, self.swapped):
            if req in queue:
                queue.remove(req)
        req.status = Status.FINISHED
