"""AsyncLLM: the engine on a background thread, with per-request async output streams (an EngineClient).

Requests are tokenized and validated on the caller's thread (errors raise there); the step
thread drains submitted requests and aborts before each step, so the event loop never waits
on a model forward. A request whose own work fails in a step gets a RequestError and the rest
carry on; only a failure that belongs to no single request fails them all (EngineError).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from ragserve.engine_args import EngineConfig
from ragserve.tokenizer import PromptTokenizer, long_text
from ragserve_engine.blend.spec import BlendSpec
from ragserve_engine.block_pool import KVEvent, KVSnapshot
from ragserve_engine.engine_client import EngineInfo, EngineStats
from ragserve_engine.kv_cache_manager import KVCacheBlocks
from ragserve_engine.llm_engine import LLMEngine
from ragserve_engine.outputs import EngineError, RequestError, RequestOutput
from ragserve_engine.sampling_params import SamplingParams
from ragserve_engine.sequence import Request

log = logging.getLogger("ragserve_engine")
T = TypeVar("T")


class AsyncLLM:
    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None) -> None:
        self.engine = engine or LLMEngine(config)
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._held = threading.Event()  # steps_held(): take submissions, run no step
        self._stop = False
        self._event_listeners: list[Callable[[list[KVEvent]], None]] = []
        graphs = self.engine.runner.decode_graphs
        if graphs is not None and self.engine.config.compile_at_start:
            graphs.capture_in_background()  # every size, before the server reports ready (launcher)
        elif graphs is not None:  # a size compiles beside the steps that run it eager
            graphs.compile_in_background()
        self._thread = threading.Thread(target=self._run, name="ragserve-engine", daemon=True)
        self._thread.start()

    # ---- EngineClient -------------------------------------------------------------------------
    @property
    def tokenizer(self) -> PromptTokenizer:
        return self.engine.tokenizer

    @property
    def info(self) -> EngineInfo:
        return self.engine.info

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        cache_salt: str | None = None,
        resume_token_ids: list[int] | None = None,
        blend: BlendSpec | None = None,
        first_token_id: int | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs; leaving the loop early (or cancellation) aborts the request."""
        args = (request_id, prompt, params, priority, cache_salt, resume_token_ids, blend, first_token_id)
        if params.guided is not None or long_text(prompt):  # grammar compilation, tokenization: not on the event loop
            req = await asyncio.to_thread(self.engine.make_request, *args)
        else:
            req = self.engine.make_request(*args)
        stream: asyncio.Queue = asyncio.Queue()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        given = None
        if first_token_id is not None:  # the answer's first token is known: it is the first output, now
            given = self.engine.output_of(req)  # before the step loop has the request
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._submit(("add", req))
        finished = False
        try:
            if given is not None:
                yield given
            while not finished:
                out = await stream.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def call(self, fn: Callable[[LLMEngine], T]) -> asyncio.Future[T]:
        """Run fn(engine) on the step thread between steps; await the returned future."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._submit(("call", (fn, loop, fut)))
        return fut

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def hash_blocks(self, token_ids: list[int], cache_salt: str | None) -> list[bytes]:
        return self.engine.kv_manager.hash_blocks(token_ids, cache_salt)

    async def pin_prefixes(self, hashes: list[list[bytes]]) -> list[KVCacheBlocks]:
        return await self.call(lambda engine: [engine.kv_manager.pin(h) for h in hashes])

    async def unpin(self, pinned: list[KVCacheBlocks]) -> None:
        def release(engine: LLMEngine) -> None:
            for blocks in reversed(pinned):  # tail first, like freeing one sequence
                engine.kv_manager.unpin(blocks)

        await self.call(release)

    def add_kv_event_listener(self, fn: Callable[[list[KVEvent]], None]) -> None:
        self.engine.pool.record_events = True
        self._event_listeners.append(fn)

    async def with_kv_snapshot(self, fn: Callable[[KVSnapshot], T]) -> T:
        return await self.call(lambda engine: fn(engine.pool.snapshot()))

    @contextlib.asynccontextmanager
    async def calibrating(self) -> AsyncIterator[None]:
        detached = await self.call(_detach)
        try:
            yield
        finally:
            await self.call(lambda engine: _forget(engine, detached))

    @contextlib.asynccontextmanager
    async def steps_held(self) -> AsyncIterator[None]:
        self._held.set()
        try:
            yield
        finally:
            self._held.clear()
            self._wake.set()

    async def num_requests(self) -> int:
        """Requests the engine holds, once every submission made before this call has been taken."""
        return await self.call(lambda engine: len(engine.requests))

    def shutdown(self) -> None:
        if (graphs := self.engine.runner.decode_graphs) is not None:
            graphs.stop()
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    # ---- step thread --------------------------------------------------------------------------
    def _submit(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _drain(self) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(arg)
            elif kind == "abort":
                self.engine.abort_request(arg)
            elif kind == "call":
                fn, loop, fut = arg
                try:
                    result = fn(self.engine)
                    loop.call_soon_threadsafe(_resolve, fut, result, None)
                except Exception as exc:  # delivered to the awaiting caller
                    loop.call_soon_threadsafe(_resolve, fut, None, exc)

    def _add(self, req: Request) -> None:
        if req.request_id not in self._streams:  # the caller already went away
            return
        try:
            self.engine.submit(req)
        except ValueError as exc:
            self._deliver(req.request_id, exc)
        except Exception as exc:  # noqa: BLE001 - this request's alone
            log.exception("request %s could not be added", req.request_id)
            self.engine.abort_request(req.request_id)
            self._deliver(req.request_id, RequestError(f"request failed: {exc}"))

    def _run(self) -> None:
        while not self._stop:
            self._drain()
            if self._held.is_set() or not self.engine.has_unfinished_requests():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bug must fail the requests, not kill the server
                log.exception("engine step failed; aborting in-flight requests")
                self._fail_all(exc)
                continue
            finally:
                for rid, exc in self.engine.take_failed().items():
                    self._deliver(rid, RequestError(f"request failed: {exc}"))
            self._publish()  # KV events first: the router knows the blocks before the client sees the answer
            for out in outputs:
                self._deliver(out.request_id, out)

    def _publish(self) -> None:
        events = self.engine.pool.take_events()
        for fn in self._event_listeners if events else ():
            fn(events)

    def _fail_all(self, exc: Exception) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)
            self._deliver(rid, EngineError(f"engine error: {exc}"))

    def _deliver(self, request_id: str, item) -> None:
        entry = self._streams.get(request_id)
        if entry is not None:
            loop, stream = entry
            loop.call_soon_threadsafe(stream.put_nowait, item)


def _detach(engine: LLMEngine) -> tuple:
    """Calibration: the cachestore connector and the compiled decode graphs set aside (restored by _forget)."""
    detached = engine.connector, engine.runner.decode_graphs
    engine.connector = engine.scheduler.remote.connector = engine.runner.decode_graphs = None
    return detached


def _forget(engine: LLMEngine, detached: tuple) -> None:
    """Reattach, and leave the engine as if it had served nothing: no cached block, no counted prompt token."""
    engine.connector, engine.runner.decode_graphs = detached
    engine.scheduler.remote.connector = engine.connector
    if not engine.pool.reset_prefix_cache():
        log.warning("calibration: KV blocks still in use; its cached blocks stay until evicted")
    engine.kv_manager.stats.queries = engine.kv_manager.stats.hits = 0
    engine.load.computed_prompt_tokens = 0


def _resolve(fut: asyncio.Future, result, exc) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
