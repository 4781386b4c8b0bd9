"""AsyncPooler: the PoolingClient of `ragserve engine --task embed`. A step thread runs the scheduler's batches
through the PoolingModel; the event loop awaits one future per input. It registers with the router like any
engine (a KV layout with no blocks: nothing to cache, no KV events)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import TypeVar

from ragserve.engine_args import EngineConfig
from ragserve.keys import KVLayout
from ragserve.model_source import load_tokenizer, model_fingerprint, resolve_model
from ragserve.tokenizer import PromptTokenizer
from ragserve_engine.async_engine import _resolve
from ragserve_engine.engine_client import EngineError, EngineInfo, EngineStats, KVEvent, KVSnapshot, PoolingInfo
from ragserve_engine.model_runner import resolve_device, resolve_dtype
from ragserve_engine.pooling.model import PoolingModel, pooler_config
from ragserve_engine.pooling.scheduler import PoolingScheduler, PoolingSequence

log = logging.getLogger("ragserve_engine.pooling")
T = TypeVar("T")
SPEED_EWMA = 0.2  # weight of the newest step in the measured tokens/s


class AsyncPooler:
    def __init__(self, config: EngineConfig) -> None:
        source = resolve_model(config.model, config.served_model_name)
        if source.kind != "hf":
            raise ValueError("--task embed needs a Hugging Face directory (config.json + *.safetensors), not a .gguf")
        device = resolve_device(config.device)
        pooler = pooler_config(source.path, config.pooling_type, config.max_model_len)
        self.model = PoolingModel(source.path, pooler, device, resolve_dtype(config.dtype, device))
        self._tok = load_tokenizer(source)
        self._tok.tokenizer.no_padding()  # a sentence-transformers tokenizer.json pads every input to 128
        self._tok.tokenizer.no_truncation()  # inputs over max_model_len are refused (or truncated on request)
        self.pooling = PoolingInfo(pooler.hidden_size, pooler.max_model_len, pooler.pooling_type, pooler.normalize,
                                   pooler.matryoshka)  # fmt: skip
        layout = KVLayout(model_fingerprint(source), "none", config.block_size, 0, 0, 0)
        self._info = EngineInfo(layout, pooler.max_model_len, 0)
        self.scheduler = PoolingScheduler(config.max_num_seqs, config.max_num_batched_tokens)
        self._lock = threading.Condition()
        self._running = 0
        self._tokens = 0  # cumulative tokens encoded
        self._speed = 0.0  # measured tokens/s
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="ragserve-pooler", daemon=True)
        self._thread.start()
        log.info("pooling %s: %s pooling, normalize=%s, %d dims, max_model_len %d", source.name,
                 pooler.pooling_type, pooler.normalize, pooler.hidden_size, pooler.max_model_len)  # fmt: skip

    # ---- PoolingClient ----------------------------------------------------------------------------
    @property
    def tokenizer(self) -> PromptTokenizer:
        return self._tok

    @property
    def info(self) -> EngineInfo:
        return self._info

    async def embed(self, prompts: list[list[int]], request_id: str) -> list[list[float]]:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in prompts]

        def done(fut: asyncio.Future) -> Callable[[object, BaseException | None], None]:
            return lambda vector, exc: loop.call_soon_threadsafe(_resolve, fut, vector, exc)

        seqs = [PoolingSequence(request_id, list(ids), done(f)) for ids, f in zip(prompts, futures, strict=True)]
        with self._lock:
            self.scheduler.add(seqs)
            self._lock.notify()
        try:
            return await asyncio.gather(*futures)
        except asyncio.CancelledError:
            self.abort(request_id)
            raise

    def abort(self, request_id: str) -> None:
        with self._lock:
            self.scheduler.abort(request_id)

    def stats(self) -> EngineStats:
        with self._lock:
            waiting, queued = len(self.scheduler.waiting), self.scheduler.waiting_tokens
        return EngineStats(
            num_running=self._running, num_waiting=waiting, kv_usage=0.0, total_blocks=0, free_blocks=0,
            prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0, prefill_tokens_per_s=self._speed,
            queued_prefill_tokens=queued, step_token_budget=self.scheduler.max_num_batched_tokens,
            computed_prompt_tokens=self._tokens,
        )  # fmt: skip

    def add_kv_event_listener(self, fn: Callable[[list[KVEvent]], None]) -> None:
        pass  # no KV cache, no events

    async def with_kv_snapshot(self, fn: Callable[[KVSnapshot], T]) -> T:
        return fn(KVSnapshot([], 0))

    @asynccontextmanager
    async def calibrating(self):
        yield

    @asynccontextmanager
    async def steps_held(self):
        yield

    async def num_requests(self) -> int:
        with self._lock:
            return len(self.scheduler.waiting) + self._running

    def shutdown(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify()
        self._thread.join(timeout=10)

    # ---- the step thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self.scheduler.has_waiting():
                    self._lock.wait()
                if self._stop:
                    return
                batch = self.scheduler.schedule()
                self._running = len(batch)
            if batch:
                self._step(batch)
            self._running = 0

    def _step(self, batch: list[PoolingSequence]) -> None:
        started = time.monotonic()
        try:
            vectors = self.model.pool([s.token_ids for s in batch]).tolist()
        except Exception as exc:  # a bug fails this batch's requests, not the server
            log.exception("pooling step failed")
            for seq in batch:
                seq.done(None, EngineError(f"pooling step failed: {exc}"))
            return
        tokens = sum(len(s.token_ids) for s in batch)
        self._tokens += tokens
        speed = tokens / max(time.monotonic() - started, 1e-6)
        self._speed = speed if not self._speed else (1 - SPEED_EWMA) * self._speed + SPEED_EWMA * speed
        for seq, vector in zip(batch, vectors, strict=True):
            seq.done(vector, None)
