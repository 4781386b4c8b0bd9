"""What the engine returns per request, shaped like vLLM's RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

from ragserve_engine.blend.spec import BlendUsage


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    metrics: RequestMetrics | None = None
    error: str | None = field(default=None)
    # migration: the text of the resume_token_ids; the outputs' text starts with it, their token_ids do not
    resumed_text: str = ""
    blend_usage: BlendUsage | None = None  # a blended prefill's prompt tokens by source; None: not blended


class RequestError(RuntimeError):
    """Processing one request failed; the engine and every other request carry on (scope `request`)."""


class EngineError(RuntimeError):
    """The engine failed as a whole and every in-flight request got this (scope `engine`)."""
