"""EngineClient: what the OpenAI server, warm-up and registration may use of a loaded engine (vLLM's name).

AsyncLLM implements it. Torch-free: the server imports this before the model loads. The values its methods
take and return (SamplingParams, RequestOutput, the errors, KV events) are re-exported here: the server
package imports nothing else of the engine (tests/common/test_layout.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

from ragserve.keys import KVLayout
from ragserve_engine.blend.spec import BlendSpec
from ragserve_engine.block_pool import KVEvent, KVSnapshot
from ragserve_engine.outputs import CompletionOutput, EngineError, RequestError, RequestOutput
from ragserve_engine.sampling_params import SamplingParams
from ragserve_engine.structured.spec import JSON_FORMAT, GrammarError, GuidedDecoding

if TYPE_CHECKING:
    from ragserve.tokenizer import PromptTokenizer
    from ragserve_engine.compilation.warmup_steps import WarmupSteps
    from ragserve_engine.kv_cache_manager import KVCacheBlocks

__all__ = [
    "BlendSpec", "CompletionOutput", "EngineClient", "EngineError", "EngineInfo", "EngineStats", "GrammarError",
    "GuidedDecoding", "JSON_FORMAT", "KVEvent", "KVSnapshot", "PoolingClient", "PoolingInfo", "RequestError",
    "RequestOutput", "SamplingParams",
]  # fmt: skip

T = TypeVar("T")


@dataclass(frozen=True)
class EngineInfo:
    """Fixed for the engine's lifetime: its KV layout (model_id, block_size, fingerprint) and capacity."""

    layout: KVLayout
    max_model_len: int
    num_blocks: int
    cachestore: str = ""  # the --cachestore it fetches from and offloads to ("": none)
    role: str = "both"  # --role (docs/disaggregation.md)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's queues, KV usage and cumulative counters (token counts for the caches).

    Named as the heartbeat's Load (proto/ragserve/v1/registry.proto) names them; the rest as their metrics."""

    num_running: int
    num_waiting: int  # waiting or swapped out
    kv_usage: float
    total_blocks: int
    free_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    external_prefix_cache_queries: int = 0
    fetched_prompt_tokens: int = 0  # cumulative prompt tokens fetched from the cachestore (external prefix hits)
    cachestore_fetches_abandoned: int = 0  # fetches given up at their deadline (the request recomputed) or aborted
    cachestore_blocks_not_imported: int = 0  # fetched blocks left out for lack of free KV blocks (recomputed)
    cachestore_offload_dropped: int = 0  # blocks never offloaded: the offload queue was full
    # KV moved through the cachestore by direction ("stored", "fetched"): bytes, seconds in the calls, requests
    kv_transfer_bytes: dict[str, int] = field(default_factory=dict)
    kv_transfer_seconds: dict[str, float] = field(default_factory=dict)
    kv_transfer_requests: dict[str, int] = field(default_factory=dict)
    num_swap_fallbacks: int = 0  # swap preemptions recomputed instead: the host swap space was full
    # measured load (ragserve_engine.load_stats), for the router's cost model; 0 until measured
    prefill_tokens_per_s: float = 0.0
    decode_step_s: float = 0.0  # a step at the current decode batch
    decode_seq_s: float = 0.0  # what each further decoding sequence adds to a step
    decode_seq_measured: bool = False  # decode_seq_s was fitted (0.0 is then a measurement)
    decode_path: str = "unmeasured"  # steps the decode figures were timed on (load_stats.decode_path)
    queued_prefill_tokens: int = 0  # waiting (past local hits) and partially prefilled prompt tokens
    step_token_budget: int = 0
    fetch_s_per_block: float = 0.0
    computed_prompt_tokens: int = 0  # cumulative prompt tokens prefilled (not cached or fetched)
    # cumulative blended-prefill prompt tokens by source (blend.spec.BlendUsage): KV that existed before the
    # request, kept; chunks first computed for the request, kept; computed by the blended forward
    blend_reused_tokens: int = 0
    blend_computed_chunk_tokens: int = 0
    blend_recomputed_tokens: int = 0
    decode_graphs_compiled: int = 0  # decode-graph capture sizes compiled (compilation/decode_graphs.py)
    decode_graphs_pending: int = 0  # sizes queued that still compile (their steps run eager)
    decode_graph_compile_seconds: float = 0.0  # spent compiling decode graphs (or loading them from the cache)
    decode_graph_cache_misses: int = 0  # decode graphs whose code was generated, not found in the compile cache
    warmup_decode_steps: WarmupSteps | None = None  # the first decode steps' times (compilation/warmup_steps.py)

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks

    @property
    def busy(self) -> bool:
        return bool(self.num_running or self.num_waiting)


class EngineClient(Protocol):
    @property
    def tokenizer(self) -> PromptTokenizer: ...

    @property
    def info(self) -> EngineInfo: ...

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        cache_salt: str | None = None,
        resume_token_ids: list[int] | None = None,
        blend: BlendSpec | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs; leaving the loop early (or cancellation) aborts the request.

        `resume_token_ids` continues a generation as if these output tokens had been generated (migration).
        `blend` marks chunks of the prompt whose stored KV a blended prefill reuses (docs/blend.md).
        Raises RequestError (this request failed alone) or EngineError (every in-flight request failed)."""
        ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def hash_blocks(self, token_ids: list[int], cache_salt: str | None) -> list[bytes]:
        """The prefix-cache keys of the full blocks of token_ids."""
        ...

    def pin_prefixes(self, hashes: list[list[bytes]]) -> Awaitable[list[KVCacheBlocks]]:
        """Hold the cached prefix of each hash chain so eviction skips it; unpin() releases them."""
        ...

    def unpin(self, pinned: list[KVCacheBlocks]) -> Awaitable[None]: ...

    def add_kv_event_listener(self, fn: Callable[[list[KVEvent]], None]) -> None:
        """fn(events) runs on the engine's step thread after every step that produced KV events."""
        ...

    def with_kv_snapshot(self, fn: Callable[[KVSnapshot], T]) -> Awaitable[T]:
        """fn(snapshot of the cached blocks) on the step thread, so no KV event happens in between."""
        ...

    def calibrating(self) -> AbstractAsyncContextManager[None]:
        """`async with`: requests generated inside leave no trace (start-up calibration): no cachestore lookup
        or offload, eager decode steps (no background graph compile beside them); on exit the prefix cache is
        reset and the prefix-cache and computed-token counters are zeroed."""
        ...

    def steps_held(self) -> AbstractAsyncContextManager[None]:
        """`async with`: the engine takes the requests submitted inside but runs no step until the block ends, so
        they are scheduled together (calibration's decode batch)."""
        ...

    def num_requests(self) -> Awaitable[int]:
        """How many requests the engine holds, counting every submission made before the call."""
        ...

    def shutdown(self) -> None: ...


@dataclass(frozen=True)
class PoolingInfo:
    """An embedding engine's (`--task embed`) pooler: vector size, input limit, and whether `dimensions` may cut it."""

    hidden_size: int
    max_model_len: int
    pooling_type: str
    normalize: bool
    matryoshka: bool


class PoolingClient(EngineClient, Protocol):
    """An engine serving embeddings (AsyncPooler): EngineClient's info, stats and registration duties, plus embed().

    It generates nothing: generate(), hash_blocks() and pins are not called on it."""

    @property
    def pooling(self) -> PoolingInfo: ...

    def embed(self, prompts: list[list[int]], request_id: str) -> Awaitable[list[list[float]]]:
        """One unit vector (or raw pooled state) per prompt; cancelling aborts the inputs not yet run."""
        ...
