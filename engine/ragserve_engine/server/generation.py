"""One OpenAI request as engine requests (one per prompt), with metrics, the request log line and aborts.

`start()` waits for every prompt's first output, so a bad request fails before any byte is
sent (a 400, not a broken stream); closing the outputs iterator or cancelling aborts them all.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator

from ragserve import tracing
from ragserve_engine.engine_client import RequestOutput, SamplingParams
from ragserve_engine.server.metrics import EngineMetrics

log = logging.getLogger("ragserve_engine.requests")
_DONE = object()


class RequestTracker:
    """Per-request metrics and the one log line: prompt tokens, cached tokens, TTFT."""

    def __init__(self, metrics: EngineMetrics, request_id: str) -> None:
        self.metrics = metrics
        self.request_id = request_id
        self.num_generated = 0
        self.last_token_time: float | None = None

    def observe(self, out: RequestOutput) -> None:
        generated = sum(len(o.token_ids) for o in out.outputs)
        if generated > self.num_generated:
            now = time.monotonic()
            if self.last_token_time is not None:
                self.metrics.itl.labels(self.metrics.model_name).observe(now - self.last_token_time)
            self.last_token_time, self.num_generated = now, generated

    def finish(self, out: RequestOutput | None) -> None:
        if out is None:
            return
        name, m = self.metrics.model_name, self.metrics
        m.prompt_tokens.labels(name).inc(len(out.prompt_token_ids))
        m.generation_tokens.labels(name).inc(self.num_generated)
        t = out.metrics
        ttft = t.first_token_time - t.arrival_time if t and t.first_token_time else None
        e2e = time.monotonic() - t.arrival_time if t else 0.0
        reason = out.outputs[0].finish_reason if out.finished and out.outputs else "abort"
        if out.finished:
            m.request_success.labels(name, reason).inc()
            m.e2e.labels(name).observe(e2e)
            if ttft is not None:
                m.ttft.labels(name).observe(ttft)
            if t and t.first_scheduled_time:
                m.queue_time.labels(name).observe(t.first_scheduled_time - t.arrival_time)
        log.info(
            "request %s: prompt_tokens=%d cached_tokens=%d generation_tokens=%d ttft=%s e2e=%.3fs finish=%s",
            self.request_id,
            len(out.prompt_token_ids),
            out.num_cached_tokens,
            self.num_generated,
            f"{ttft:.3f}s" if ttft is not None else "-",
            e2e,
            reason,
        )


class Generation:
    trace_parent = None  # the caller's trace context (tracing on, `traceparent` sent)

    def __init__(self, server, prompts: list[str | list[int]], params: SamplingParams, request_id: str, **kw) -> None:
        self.server = server
        self.request_id = request_id
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        self.gens = [self._tracked(rid, p, _copy(params), **kw) for rid, p in zip(ids, prompts, strict=True)]
        self.firsts: list[RequestOutput] = []

    async def _tracked(self, rid: str, prompt, params: SamplingParams, **kw) -> AsyncGenerator[RequestOutput]:
        tracker = RequestTracker(self.server.metrics, rid)
        gen = self.server.llm.generate(prompt, params, rid, **kw)
        last = None
        if span := tracing.start("engine.request", self.trace_parent, {"ragserve.request_id": rid}):
            tracing.live[rid] = span
        self.server.inflight += 1
        try:
            async for out in gen:
                tracker.observe(out)
                last = out
                yield out
        finally:
            self.server.inflight -= 1
            await gen.aclose()  # aborts the engine request if it did not finish
            tracker.finish(last)
            _end_span(tracing.live.pop(rid, None), last)

    async def start(self) -> None:
        """Submit every prompt and wait for each first output; raises the first error (ValueError: 400)."""
        tasks = [asyncio.ensure_future(anext(g)) for g in self.gens]
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            if pending:  # something failed
                raise next(t.exception() for t in done if t.exception() is not None)
            self.firsts = [t.result() for t in tasks]
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.close()
            raise

    async def close(self) -> None:
        for gen in self.gens:
            await gen.aclose()

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) in arrival order, starting with the first outputs."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, gen: AsyncGenerator[RequestOutput], first: RequestOutput) -> None:
            try:
                queue.put_nowait((i, first))
                if not first.finished:
                    async for out in gen:
                        queue.put_nowait((i, out))
            except Exception as exc:
                queue.put_nowait((i, exc))
            finally:
                queue.put_nowait((i, _DONE))

        tasks = [
            asyncio.ensure_future(pump(i, g, f)) for i, (g, f) in enumerate(zip(self.gens, self.firsts, strict=True))
        ]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is _DONE:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.close()


def _end_span(span, out: RequestOutput | None) -> None:
    """The engine's span gets queue, prefill and decode children from the request's recorded times."""
    if span is None:
        return
    t = out.metrics if out is not None else None
    if t is not None:
        cached, prompt = out.num_cached_tokens, len(out.prompt_token_ids)
        fetched = span.attributes.get(tracing.FETCHED_TOKENS, 0)
        prefill = {"ragserve.prompt_tokens": prompt, "ragserve.cached_tokens": cached}
        prefill |= {tracing.FETCHED_TOKENS: fetched, "ragserve.computed_tokens": prompt - cached}
        tracing.record("engine.queue", span, t.arrival_time, t.first_scheduled_time)
        tracing.record("engine.prefill", span, t.first_scheduled_time, t.first_token_time, prefill)
        decode = {"ragserve.generation_tokens": sum(len(o.token_ids) for o in out.outputs)}
        tracing.record("engine.decode", span, t.first_token_time, t.finished_time or time.monotonic(), decode)
    span.end()


def _copy(params: SamplingParams) -> SamplingParams:
    return dataclasses.replace(params, stop=list(params.stop), stop_token_ids=list(params.stop_token_ids))
