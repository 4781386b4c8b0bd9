"""Everything one engine server holds: the EngineClient (once loaded), metrics, warm-ups, cluster duties."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ragserve.engine_args import EngineConfig, ServerConfig
from ragserve.http.errors import ApiError
from ragserve_engine.engine_client import EngineClient, EngineStats
from ragserve_engine.server.metrics import EngineMetrics
from ragserve_engine.server.prefiller import Prefiller
from ragserve_engine.server.serving_chat import ChatServing
from ragserve_engine.server.serving_completion import CompletionServing
from ragserve_engine.server.serving_pooling import PoolingServing
from ragserve_engine.server.warmup import WarmupManager

if TYPE_CHECKING:
    from fastapi import Request

    from ragserve_engine.server.protocol import SamplingRequest
    from ragserve_engine.server.registration import RegistrationClient
    from ragserve_engine.server.vllm_kv_events import VllmKVEventPublisher

LOADING, READY, DRAINING, FAILED = "loading", "ready", "draining", "failed"


@dataclass
class EngineServer:
    config: ServerConfig
    engine_config: EngineConfig
    model_name: str
    metrics: EngineMetrics | None = None
    llm: EngineClient | None = None  # set when the model is loaded
    status: str = LOADING
    inflight: int = 0  # engine requests the HTTP side is waiting on
    registration: RegistrationClient | None = None  # with --router
    kv_publisher: VllmKVEventPublisher | None = None  # with --kv-events-config that publishes

    def __post_init__(self) -> None:
        self.metrics = self.metrics or EngineMetrics(self.model_name)
        self.chat = ChatServing(self)
        self.completion = CompletionServing(self)
        self.pooling = PoolingServing(self)
        self.warmups = WarmupManager(self)
        self.prefiller = Prefiller(self.config, self.engine_config.role, self.model_name, self.metrics.registry)

    def attach(self, llm: EngineClient) -> None:
        """The model is loaded: start serving it."""
        self.llm = llm
        info = llm.info
        self.metrics.attach_engine(self.stats, info.layout.block_size, info.num_blocks)
        if (cache := getattr(llm.tokenizer, "cache", None)) is not None:
            self.metrics.attach_token_cache(cache)
        if self.kv_publisher is not None:
            self.kv_publisher.attach(llm)
            self.metrics.attach_kv_publisher(self.kv_publisher.stats)
        self.status = READY

    async def prefill_leg(self, request: Request, path: str, body: dict, req: SamplingRequest) -> None:
        """The prefill leg the endpoint picker named (prefiller.py), if any; its first token starts the answer
        when the request can start there."""
        first = await self.prefiller.run(request, path, body, self.llm.info.max_model_len)
        if first is not None:
            req.first_token_id = first

    @property
    def embeds(self) -> bool:
        """An embedding engine (--task embed): /v1/embeddings, /v1/rerank and /v1/score instead of generation."""
        return self.engine_config.task == "embed"

    def stats(self) -> EngineStats | None:
        return self.llm.stats() if self.llm is not None else None

    @property
    def busy(self) -> bool:
        """Requests still running: the HTTP side waits on some, or the engine has queued work."""
        stats = self.stats()
        return self.inflight > 0 or (stats is not None and stats.busy)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist.", "model_not_found", "model")

    def check_loaded(self) -> None:
        if self.llm is None:
            message = "the model failed to load" if self.status == FAILED else "the model is still loading; retry"
            raise ApiError(503, message, "not_ready")

    def check_accepting(self) -> None:
        """New generation requests: refused while loading or draining."""
        if self.status == DRAINING:
            raise ApiError(503, "this engine is shutting down; send the request to another engine", "draining")
        self.check_loaded()
