"""LLMEngine: requests in, RequestOutputs out, one `step()` at a time.

Per-request work in a step (sampling, stop checks, detokenizing, logprobs, beam search) is
isolated: an exception there fails that request alone (see `take_failed`), never its batch mates.
"""

from __future__ import annotations

import logging
import time

import torch

from ragserve.engine_args import EngineConfig
from ragserve.model_source import load_tokenizer, resolve_model
from ragserve_engine.beam_search import beam_step
from ragserve_engine.blend.runner import Blender
from ragserve_engine.block_pool import BlockPool
from ragserve_engine.compilation.events import compile_epoch, quiet_since
from ragserve_engine.compilation.warmup_steps import WarmupSteps
from ragserve_engine.engine_client import EngineInfo, EngineStats
from ragserve_engine.input_processor import InputProcessor
from ragserve_engine.kv_cache_manager import KVCacheManager
from ragserve_engine.kv_tail import SavingOutputs
from ragserve_engine.load_stats import LoadTracker
from ragserve_engine.model_runner import ModelOutput, ModelRunner
from ragserve_engine.models.llama import LlamaForCausalLM
from ragserve_engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from ragserve_engine.sample_step import SampleStep
from ragserve_engine.sampler import Sampler, top_logprobs
from ragserve_engine.sampling_params import SamplingParams
from ragserve_engine.scheduler import Scheduler
from ragserve_engine.scheduler_output import SchedulerOutput
from ragserve_engine.sequence import Request, Sequence
from ragserve_engine.stop import StopCriteria
from ragserve_engine.structured.grammar import GrammarCompiler

REMOTE_POLL_S = 0.05  # longest idle wait for a cachestore fetch before the step loop looks again

log = logging.getLogger("ragserve_engine")


class LLMEngine:
    def __init__(self, config: EngineConfig, model: LlamaForCausalLM | None = None) -> None:
        self.config = config
        self.source = resolve_model(config.model, config.served_model_name)
        self.tokenizer = load_tokenizer(self.source)
        self.runner = ModelRunner(config, self.source, model)
        self.layout = self.runner.layout  # block size, KV dtype, model id: one holder, readers go through it
        self.model_id = self.layout.model_id
        mc = self.runner.model_config
        if config.max_model_len and config.max_model_len > mc.max_position:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's {mc.max_position} positions")
        self.max_model_len = config.max_model_len or mc.max_position
        self.pool = BlockPool(self.runner.num_blocks, config.enable_prefix_caching, external_keys=self._chunk_keys)
        self.kv_manager = KVCacheManager(self.pool, self.layout, self.runner.num_swap_blocks)
        self.load = LoadTracker(config.max_num_batched_tokens)
        self.warmup_steps = WarmupSteps()  # the first decode steps' times (ragserve:warmup_decode_step_seconds)
        self.connector = None
        if config.cachestore:  # a fetch waits at most about as long as recomputing its blocks
            from ragserve_engine.kv_connector import CacheStoreConnector

            self.connector = CacheStoreConnector.from_config(
                config,
                self.layout.fingerprint(),
                self.runner.kv_cache,
                self.kv_manager,
                lambda: self.load.prefill_tokens_per_s,
            )
        self.scheduler = Scheduler(config, self.kv_manager, self.connector)
        self.saving = SavingOutputs(self.connector) if self.connector and config.role == "prefill" else None
        store = self.connector.client if self.connector else None
        self.blender = Blender(
            self.runner, self.kv_manager.root, config.blend_recompute_fraction, config.blend_cache_memory,
            cachestore=store, listener=self.pool.external_event,  # chunk keys reach the router with block events
        )  # fmt: skip
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        self.failed: dict[str, Exception] = {}  # request id -> what failed it during the last steps
        eos_ids = frozenset(mc.eos_token_ids) | {t for t in [self.tokenizer.eos_token_id] if t is not None}
        self.stop_criteria = StopCriteria(self.tokenizer, eos_ids, self.max_model_len)
        self.grammars = GrammarCompiler(self.tokenizer, mc.vocab_size, sorted(eos_ids))
        self.sample_step = SampleStep(
            self.sampler, self.grammars, self.stop_criteria, self.kv_manager, self.runner.device,
            config.enable_jump_forward, self._guard, self.requests,
        )  # fmt: skip
        self.processor = InputProcessor(
            config, self.tokenizer, self.kv_manager, self.grammars, self.runner.device, mc.vocab_size,
            self.max_model_len, self.layout.block_size, self.pool.num_blocks,
        )  # fmt: skip

    def _chunk_keys(self) -> list[bytes]:
        """The blend chunk keys held (the pool reports them with its cached blocks)."""
        return list(self.blender.store.entries)

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(
            self.layout, self.max_model_len, self.pool.num_blocks, self.config.cachestore or "", self.config.role
        )

    # ---- requests -------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None, **kw
    ) -> Request:
        """make_request (kw: priority, cache_salt), then submit."""
        req = self.make_request(request_id, prompt, params, **kw)
        self.submit(req)
        return req

    def make_request(self, *args, **kw) -> Request:
        """Tokenize and validate without touching engine state (safe from any thread): InputProcessor.make_request."""
        return self.processor.make_request(*args, **kw)

    def submit(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self._drop(request_id)
        return None if req is None else self.output_of(req)

    def _drop(self, request_id: str) -> Request | None:
        """Forget a request and free what it holds; its live sequences end as "abort"."""
        if self.saving is not None:
            self.saving.abort(request_id)
        req = self.requests.pop(request_id, None)
        if req is not None:
            for seq in req.live_seqs:
                seq.finish_reason = "abort"
            self.scheduler.finish(req)
        return req

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self.saving)

    # ---- stepping ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if not out.scheduled:
            self.runner.copy_blocks(out)  # a step may only preempt: its swap-outs still happen
            if self.scheduler.remote:  # only cachestore fetches pending: wait for one, do not spin
                self.scheduler.remote.wait(REMOTE_POLL_S)
            elif self.scheduler.has_work() and not out.num_preempted:  # work queued, nothing fits: a bug
                raise RuntimeError(f"scheduler stalled with {self.stats()}")
            elif self.saving:  # only answers waiting for the store to take their blocks
                self.saving.wait(REMOTE_POLL_S)
            return self.saving.hold([]) if self.saving is not None else []
        t0, epoch, graph_steps = time.perf_counter(), compile_epoch(), self._graph_steps()
        model_out = self.blender.execute(out)
        for rid, exc in self.blender.take_failed().items():  # out no longer holds them
            self.failed[rid] = exc
            self._drop(rid)
        seconds = time.perf_counter() - t0
        self.scheduler.update_after_step(out)
        timed = quiet_since(epoch)  # a step that compiled, or ran beside a compile, says nothing about speed
        graph = self._graph_steps() > graph_steps  # the step ran through a compiled decode graph
        self.load.observe(out, seconds, self.scheduler.queued_prefill_tokens(), timed, graph)
        if all(s.num_new_tokens == 1 for s in out.scheduled):
            self.warmup_steps.observe(seconds)
        if self.connector is not None and out.newly_cached:
            self.connector.offload(out.newly_cached, out.scheduled)
        if self.saving is not None:  # tails too, in the store before the answer
            self.saving.offload(self.kv_manager, out.scheduled)
            return self.saving.hold(self._process(out, model_out))
        return self._process(out, model_out)

    def _graph_steps(self) -> int:
        graphs = self.runner.decode_graphs
        return graphs.stats.steps if graphs else 0

    def _process(self, out: SchedulerOutput, model_out: ModelOutput) -> list[RequestOutput]:
        now = time.monotonic()
        by_request: dict[str, list[tuple[Sequence, int]]] = {}  # rows of model_out.logits
        row = 0
        for s in out.scheduled:
            if s.seq.seq_id in model_out.prompt_logits:
                self._guard(s.request, self._prompt_logprobs, s.request, *model_out.prompt_logits[s.seq.seq_id])
            if s.sample:
                by_request.setdefault(s.request.request_id, []).append((s.seq, row))
                row += 1
        touched = {s.request.request_id: s.request for s in out.scheduled}
        sampled = []
        for rid, rows in by_request.items():
            req = touched[rid]
            if req.first_token_time is None:
                req.first_token_time = now
            if req.params.use_beam_search:
                beam_rows = [(seq, model_out.logits[i]) for seq, i in rows]
                self._guard(req, beam_step, req, beam_rows, self.kv_manager, self.stop_criteria)
            else:
                sampled.append((req, rows))
        self.sample_step(sampled, model_out.logits)
        outputs = []
        for rid, req in touched.items():
            if rid in self.failed or (rid not in by_request and req.params.prompt_logprobs is None):
                continue  # failed, or a prefill chunk with nothing new to report
            if not req.live_seqs:
                self.scheduler.finish(req)
                self.requests.pop(rid, None)
            if not req.params.use_beam_search or req.finished:
                self._guard(req, lambda r: outputs.append(self.output_of(r)), req)
        return outputs

    def _guard(self, req: Request, fn, *args) -> None:
        """fn(*args) for one request: an exception fails that request alone (reported by take_failed)."""
        if req.request_id in self.failed:
            return
        try:
            fn(*args)
        except Exception as exc:
            log.exception("request %s failed in a step; its batch mates carry on", req.request_id)
            self.failed[req.request_id] = exc
            self._drop(req.request_id)

    def take_failed(self) -> dict[str, Exception]:
        """Requests failed (and already aborted) by their own per-request work since the last call."""
        failed, self.failed = self.failed, {}
        return failed

    def _prompt_logprobs(self, req: Request, start: int, logits: torch.Tensor) -> None:
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None]
        lp = torch.log_softmax(logits.float(), dim=-1)
        k = req.params.prompt_logprobs or 0
        for i in range(lp.shape[0]):
            nxt = start + i + 1
            if nxt < len(req.prompt_token_ids):
                req.prompt_logprobs.append(top_logprobs(lp[i], k, req.prompt_token_ids[nxt]))

    def output_of(self, req: Request) -> RequestOutput:
        outs = [
            CompletionOutput(
                s.index,
                s.output_text,
                s.output_token_ids[req.num_resumed_tokens :],
                s.cumulative_logprob,
                list(s.logprobs) if req.params.logprobs is not None else None,
                s.finish_reason,
                s.stop_reason,
            )  # fmt: skip
            for s in sorted(req.seqs, key=lambda s: s.index)
        ]
        metrics = RequestMetrics(req.arrival_time, req.first_scheduled_time, req.first_token_time)
        metrics.num_preemptions = req.num_preemptions
        if req.finished:
            metrics.finished_time = time.monotonic()
        return RequestOutput(
            req.request_id, req.prompt, req.prompt_token_ids, outs, req.finished,
            max(req.num_cached_tokens, 0), req.prompt_logprobs, metrics, resumed_text=req.resumed_text,
            blend_usage=req.blend.usage if req.blend else None,
        )  # fmt: skip

    def stats(self) -> EngineStats:
        graphs = self.runner.decode_graphs
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.scheduler.swapped) + len(self.scheduler.remote),
            kv_usage=self.pool.usage(),
            total_blocks=self.pool.num_blocks,
            free_blocks=self.pool.num_free_blocks,
            prefix_cache_queries=self.kv_manager.stats.queries,
            prefix_cache_hits=self.kv_manager.stats.hits,
            num_preemptions=self.scheduler.num_preemptions,
            external_prefix_cache_queries=self.connector.stats.queries if self.connector else 0,
            fetched_prompt_tokens=self.connector.stats.hits if self.connector else 0,
            cachestore_fetches_abandoned=self.connector.stats.abandoned if self.connector else 0,
            cachestore_blocks_not_imported=self.connector.stats.not_imported if self.connector else 0,
            cachestore_offload_dropped=self.connector.stats.dropped if self.connector else 0,
            kv_transfer_bytes=dict(self.connector.stats.transfer_bytes) if self.connector else {},
            kv_transfer_seconds=dict(self.connector.stats.transfer_seconds) if self.connector else {},
            kv_transfer_requests=dict(self.connector.stats.transfer_requests) if self.connector else {},
            num_swap_fallbacks=self.kv_manager.swap.num_fallbacks,
            prefill_tokens_per_s=self.load.prefill_tokens_per_s,
            decode_step_s=self.load.decode_step_s(len(self.scheduler.running)),
            decode_seq_s=self.load.decode_seq_s,
            decode_seq_measured=self.load.decode_seq_measured,
            decode_path=self.load.decode_path(graphs is not None),
            queued_prefill_tokens=self.load.queued_prefill_tokens,
            step_token_budget=self.config.max_num_batched_tokens,
            fetch_s_per_block=self.connector.stats.fetch_s_per_block if self.connector else 0.0,
            computed_prompt_tokens=self.load.computed_prompt_tokens,
            blend_reused_tokens=self.blender.counters.reused_tokens,
            blend_computed_chunk_tokens=self.blender.counters.computed_chunk_tokens,
            blend_recomputed_tokens=self.blender.counters.recomputed_tokens,
            decode_graphs_compiled=len(graphs.stats.compiled) if graphs else 0,
            decode_graphs_pending=graphs.num_pending if graphs else 0,
            decode_graph_compile_seconds=graphs.stats.total_compile_seconds if graphs else 0.0,
            decode_graph_cache_misses=graphs.stats.cache_misses if graphs else 0,
            warmup_decode_steps=self.warmup_steps,
        )
