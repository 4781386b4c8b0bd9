"""OpenAI request bodies (pydantic) and their translation to SamplingParams.

Unknown fields are ignored like OpenAI does; features the engine lacks are refused with a
400 rather than silently ignored. Before any field is read, the body passes the request limits
the router applies too (ragserve.http.limits: Unicode, sizes, roles, caps).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ragserve.http.limits import check_json, check_request
from ragserve.tokenizer import normalize_messages
from ragserve_engine.engine_client import GuidedDecoding, SamplingParams
from ragserve_engine.server.structured import guided_decoding

Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class ApiRequest(Lenient):
    """A whole request body."""

    @model_validator(mode="before")
    @classmethod
    def _limits(cls, data: Any) -> Any:
        if isinstance(data, dict):
            cls.check_limits(data)  # raises ApiError 400 naming the field
        return data

    @classmethod
    def check_limits(cls, data: dict) -> None:
        check_json(data)


class ContentPart(Lenient):
    type: str
    text: str | None = None


class ChatMessage(Lenient):
    role: str
    content: str | list[ContentPart] | None = None

    def render_dict(self) -> dict[str, Any]:
        """The message as the client sent it, text parts joined (the chat template expects a string)."""
        return normalize_messages([self.model_dump(exclude_unset=True)])[0]


class StreamOptions(Lenient):
    include_usage: bool = False


class SamplingRequest(ApiRequest):
    """Fields shared by chat and completions (OpenAI's plus vLLM's extensions)."""

    model: str | None = None
    max_tokens: int | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: int = 0
    cache_salt: str | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    return_token_ids: bool = False  # vLLM's: choices carry the token ids (of the chunk, when streaming)
    resume_token_ids: list[int] | None = None  # migration: continue after these output tokens
    first_token_id: int | None = None  # disaggregated prefill: the first output token, sampled by the prefill engine
    response_format: dict[str, Any] | None = None  # structured outputs (server/structured.py)
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _supported(self) -> SamplingRequest:
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        if self.cache_salt is not None and not self.cache_salt:
            raise ValueError("cache_salt must be a non-empty string")
        if self.resume_token_ids and (self.n != 1 or self.use_beam_search):
            raise ValueError("resume_token_ids needs n=1 and no beam search")
        return self

    @property
    def resumed(self) -> bool:
        return bool(self.resume_token_ids)

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def guided(self) -> GuidedDecoding | None:
        """The grammar the output follows (raises ApiError naming the field)."""
        return guided_decoding(self)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None):
        """Raises ValueError naming the field on bad values (SamplingParams validates)."""
        return SamplingParams(
            guided=self.guided(),
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            stop=self.stop_strings,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            use_beam_search=self.use_beam_search,
            beam_width=self.n,
            length_penalty=self.length_penalty,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)

    @classmethod
    def check_limits(cls, data: dict) -> None:
        check_request(data, chat=True)

    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None  # checked by server/tools.py
    tool_choice: Any = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _chat_supported(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    def to_sampling_params(self) -> SamplingParams:
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(limit, (self.top_logprobs or 0) if self.logprobs else None)

    def render_messages(self) -> list[dict[str, Any]]:
        return [m.render_dict() for m in self.messages]


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]

    @classmethod
    def check_limits(cls, data: dict) -> None:
        check_request(data, chat=False)

    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _completion_supported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (use n, or use_beam_search)")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt of a (possibly batched) request."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)

    def to_sampling_params(self) -> SamplingParams:
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        return self.sampling_params(self.max_tokens, self.logprobs, prompt_logprobs)


class TokenizeRequest(ApiRequest):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Any] | None = None  # chat tools, rendered into the prompt as chat completions render them
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(ApiRequest):
    model: str | None = None
    tokens: list[int]


class WarmupRequest(ApiRequest):
    """Prefixes to prefill into the prefix cache: raw texts, or chat-message prefixes."""

    model: str | None = None
    texts: list[str] | None = None
    messages: list[list[ChatMessage]] | None = None
    pin: bool = False
    cache_salt: str | None = None

    @model_validator(mode="after")
    def _one_input(self) -> WarmupRequest:
        if bool(self.texts) == bool(self.messages):
            raise ValueError("give exactly one non-empty list: texts or messages")
        if self.cache_salt is not None and not self.cache_salt:
            raise ValueError("cache_salt must be a non-empty string")
        return self
