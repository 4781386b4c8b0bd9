"""SimEngine: an EngineClient whose steps are asyncio sleeps of the engine's cost model.

Continuous batching as the real scheduler does it: FCFS admission while max_num_seqs and the KV pool allow, a
token budget per step spent on one token per decoding sequence first, then on (chunked) prefills past their
prefix-cache hits, under the engine's per-step prefill cap and long-prompt turns. A step lasts decode_base_s +
decode_seq_s x decoding sequences + prefill tokens / prefill_tokens_per_s (the line the real engine fits and
reports, ragserve_engine.load_stats). Every generated token is the same token, so no text is real; usage, cached
tokens and KV events are.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

from ragserve.keys import KVLayout
from ragserve.tokenizer import PromptTokenizer, encode_beside_loop, long_text
from ragserve_engine.block_pool import KVCacheBlocks
from ragserve_engine.compilation.warmup_steps import WarmupSteps
from ragserve_engine.engine_client import (
    CompletionOutput,
    EngineInfo,
    EngineStats,
    KVEvent,
    KVSnapshot,
    RequestOutput,
    SamplingParams,
)
from ragserve_engine.outputs import RequestMetrics
from ragserve_engine.sim.kv import SimKV, SimSeq


@dataclass(frozen=True)
class SimCost:
    """Step costs; the defaults are SmolLM2-135M fp32 on this repository's 2-core CPU (bench/results/engine-*)."""

    prefill_tokens_per_s: float = 2000.0
    decode_base_s: float = 0.032
    decode_seq_s: float = 0.0006

    def step_s(self, num_decoding: int, num_prefill_tokens: int) -> float:
        return self.decode_base_s + self.decode_seq_s * num_decoding + num_prefill_tokens / self.prefill_tokens_per_s


@dataclass
class SimRequest:
    request_id: str
    prompt_ids: list[int]
    seq: SimSeq
    params: SamplingParams
    out: asyncio.Queue
    metrics: RequestMetrics
    num_computed: int = 0  # prompt tokens computed (hits count as computed)
    num_generated: int = 0


@dataclass
class SimEngine:
    tok: PromptTokenizer
    layout: KVLayout
    num_blocks: int
    cost: SimCost = field(default_factory=SimCost)
    max_model_len: int = 4096
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0  # as the engine's: most tokens one prefill takes a step (0: none)
    max_long_partial_prefills: int = 0  # with the cap: most prompts longer than it prefilled at once (0: any)

    def __post_init__(self) -> None:
        self.kv = SimKV(self.layout, self.num_blocks)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.listeners: list[Callable[[list[KVEvent]], None]] = []
        self.computed_prompt_tokens = 0
        self.warmup = WarmupSteps()  # the real engine's warm-up histogram; a sim never compiles
        self.wake = asyncio.Event()
        self.loop_task: asyncio.Task | None = None
        self.token_id = self.tok.encode(" ok", add_special_tokens=False)[-1]
        self.piece = self.tok.decode([self.token_id])

    # ---- EngineClient --------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> PromptTokenizer:
        return self.tok

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(self.layout, self.max_model_len, self.num_blocks)

    async def generate(
        self, prompt, params: SamplingParams, request_id: str, priority: int = 0, cache_salt: str | None = None,
        resume_token_ids: list[int] | None = None, blend=None, first_token_id: int | None = None,
    ) -> AsyncIterator[RequestOutput]:  # fmt: skip
        if first_token_id is not None:
            raise ValueError("the sim engine does not simulate first_token_id (disaggregated decode)")
        if isinstance(prompt, str):  # beside the event loop when long, as the engine does
            prompt = await encode_beside_loop(partial(self.tok.encode, prompt), long_text(prompt))
        req = self._request(prompt, params, request_id, cache_salt, resume_token_ids, blend)
        self.waiting.append(req)
        self._kick()
        finished = False
        try:
            while not finished:
                out = await req.out.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._drop(req)

    def _request(self, prompt, params, request_id, cache_salt, resume_token_ids, blend) -> SimRequest:
        if resume_token_ids or blend is not None or params.logprobs is not None or params.prompt_logprobs is not None:
            raise ValueError("the sim engine does not simulate resume_token_ids, blend or logprobs")
        if params.guided is not None:
            raise ValueError(f"the sim engine does not enforce grammars ({params.guided.param})")
        ids = list(prompt)  # token ids: generate tokenized a text prompt
        n, vocab = len(ids), self.tok.vocab_size
        if not ids or any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt must be a non-empty list of token ids in [0, {vocab})")
        if params.max_tokens is None:
            params.max_tokens = max(1, self.max_model_len - n)
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len")
        if self.kv.blocks_needed(n + params.max_tokens) > self.num_blocks:
            raise ValueError(f"request needs more KV blocks than the cache's {self.num_blocks}")
        seq = SimSeq(list(ids), n, cache_salt)
        self.kv.hash_blocks(ids[: self.layout.block_size], cache_salt)  # an unhashable salt fails here
        return SimRequest(request_id, ids, seq, params, asyncio.Queue(), RequestMetrics(time.monotonic()))

    def abort(self, request_id: str) -> None:
        for req in [*self.waiting, *self.running]:
            if req.request_id == request_id:
                self._drop(req)

    def stats(self) -> EngineStats:
        pool = self.kv.pool
        decoding = sum(1 for r in self.running if r.num_computed >= r.seq.num_prompt_tokens)
        queued = sum(r.seq.num_prompt_tokens - r.num_computed for r in [*self.waiting, *self.running])
        return EngineStats(
            num_running=len(self.running), num_waiting=len(self.waiting), kv_usage=pool.usage(),
            total_blocks=pool.num_blocks, free_blocks=pool.num_free_blocks, prefix_cache_queries=self.kv.queries,
            prefix_cache_hits=self.kv.hits, num_preemptions=0, prefill_tokens_per_s=self.cost.prefill_tokens_per_s,
            decode_step_s=self.cost.step_s(max(1, decoding), 0), decode_seq_s=self.cost.decode_seq_s,
            decode_seq_measured=True, decode_path="graph", queued_prefill_tokens=queued,
            step_token_budget=self.max_num_batched_tokens, computed_prompt_tokens=self.computed_prompt_tokens,
            warmup_decode_steps=self.warmup,
        )  # fmt: skip

    def hash_blocks(self, token_ids: list[int], cache_salt: str | None) -> list[bytes]:
        return self.kv.hash_blocks(token_ids, cache_salt)

    async def pin_prefixes(self, hashes: list[list[bytes]]) -> list[KVCacheBlocks]:
        return [self.kv.pin(chain) for chain in hashes]

    async def unpin(self, pinned: list[KVCacheBlocks]) -> None:
        for blocks in reversed(pinned):  # tail first, like freeing one sequence
            self.kv.pool.free_blocks(list(reversed(blocks.blocks)))

    def add_kv_event_listener(self, fn: Callable[[list[KVEvent]], None]) -> None:
        self.listeners.append(fn)

    async def with_kv_snapshot(self, fn):
        self._publish()  # events so far go out first: the snapshot then has none pending
        return fn(KVSnapshot(list(self.kv.pool.cached), 0))

    @asynccontextmanager
    async def calibrating(self):
        yield

    @asynccontextmanager
    async def steps_held(self):
        yield

    async def num_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def shutdown(self) -> None:
        if self.loop_task is not None:
            self.loop_task.cancel()

    # ---- the simulated scheduler ---------------------------------------------------------------------
    def _kick(self) -> None:
        if self.loop_task is None or self.loop_task.done():
            self.loop_task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while self.waiting or self.running:
            self._admit()
            if not self.running:  # the head of the queue waits for blocks no running request will free
                await asyncio.sleep(self.cost.decode_base_s)
                continue
            decoding = [r for r in self.running if r.num_computed >= r.seq.num_prompt_tokens]
            chunks = self._chunks(self.max_num_batched_tokens - len(decoding))
            now = time.monotonic()
            for r, _ in chunks:
                r.metrics.first_scheduled_time = r.metrics.first_scheduled_time or now
            step_s = self.cost.step_s(len(decoding), sum(t for _, t in chunks))
            await asyncio.sleep(step_s)
            if decoding:
                self.warmup.observe(step_s)
            for r in decoding:
                if r in self.running:  # not aborted meanwhile
                    self._emit(r)
            for r, take in chunks:
                if r in self.running:
                    r.num_computed += take
                    self.computed_prompt_tokens += take
                    self.kv.cache(r.seq, r.num_computed)
                    if r.num_computed == r.seq.num_prompt_tokens:
                        self._emit(r)
            self._publish()

    def _chunks(self, budget: int) -> list[tuple[SimRequest, int]]:
        """This step's prefill chunks, in admission order: each at most the cap, and prompts with more than the cap
        left only while fewer than max_long_partial_prefills of them are taking a chunk (the others wait their
        turn, shorter ones pass them), as the engine's scheduler does."""
        cap, limit = self.long_prefill_token_threshold, self.max_long_partial_prefills
        chunks, longs = [], 0
        for r in self.running:
            left = r.seq.num_prompt_tokens - r.num_computed
            if left <= 0 or budget <= 0:
                continue
            if cap and left > cap:
                if limit and longs >= limit:
                    continue
                longs, left = longs + 1, cap
            chunks.append((r, min(budget, left)))
            budget -= chunks[-1][1]
        return chunks

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            if not self.kv.admit(r.seq, r.seq.num_prompt_tokens + r.params.max_tokens):
                return
            r.num_computed = r.seq.num_cached_tokens
            self.running.append(self.waiting.popleft())

    def _emit(self, r: SimRequest) -> None:
        """One sampled token: the request's next output (and its end)."""
        r.num_generated += 1
        r.seq.token_ids.append(self.token_id)
        now = time.monotonic()
        r.metrics.first_token_time = r.metrics.first_token_time or now
        done = r.num_generated >= r.params.max_tokens
        if done:
            r.metrics.finished_time = now
            self.kv.cache(r.seq, len(r.seq.token_ids) - 1)  # the last token is sampled, never written
            self._drop(r)
        ids = [self.token_id] * r.num_generated
        outputs = [
            CompletionOutput(i, self.piece * r.num_generated, ids, finish_reason="length" if done else None)
            for i in range(r.params.n)
        ]
        r.out.put_nowait(
            RequestOutput(r.request_id, None, r.prompt_ids, outputs, done,
                          r.seq.num_cached_tokens, metrics=r.metrics)
        )  # fmt: skip

    def _drop(self, r: SimRequest) -> None:
        if r in self.running:
            self.running.remove(r)
            self.kv.free(r.seq)
        elif r in self.waiting:
            self.waiting.remove(r)
        self._publish()

    def _publish(self) -> None:
        events = self.kv.pool.take_events()
        if events:
            for fn in self.listeners:
                fn(events)
