"""SamplingParams: how one request is decoded. Invalid values raise ValueError naming the field."""

from __future__ import annotations

from dataclasses import dataclass, field

from ragserve_engine.structured.spec import GuidedDecoding


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs per generated token
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] = field(default_factory=list)  # with logprobs: these tokens' logprobs too
    use_beam_search: bool = False
    beam_width: int = 1
    length_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    guided: GuidedDecoding | None = None  # structured outputs: a grammar every sequence follows

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        if self.use_beam_search:
            self.beam_width = max(self.beam_width, self.n)
        checks = [
            ("n", 1 <= self.n <= 64, "must be in [1, 64]"),
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be in [0, 100]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be -1, 0 (disabled) or positive"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "must be in (0, 10]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be at least 1"),
            ("min_tokens", 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens), "must be in [0, max_tokens]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "must be in [0, 20]"),
            ("beam_width", 1 <= self.beam_width <= 16, "must be in [1, 16]"),
            ("stop_token_ids", all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "must be token ids"),
            ("logprob_token_ids", all(isinstance(t, int) and t >= 0 for t in self.logprob_token_ids), "must be ids"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
        ]
        for name, ok, message in checks:
            if not ok:
                raise ValueError(f"invalid sampling parameter {name}={getattr(self, name)!r}: {message}")
        if self.use_beam_search and (self.top_p < 1.0 or self.top_k or self.min_p):
            raise ValueError("beam search does not combine with top_p, top_k or min_p")
        if self.use_beam_search and self.guided is not None:
            name = self.guided.param
            raise ValueError(f"invalid sampling parameter use_beam_search=True: does not combine with {name}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def continues_after_first_token(self) -> str:
        """Why a request cannot start from a first token another engine sampled (first_token_id; "" when it can):
        one sample, no token logprobs (the first one's are not carried over), at least one more token to go."""
        if self.n != 1 or self.use_beam_search:
            return "first_token_id needs n=1 and no beam search"
        if self.logprobs is not None or self.prompt_logprobs is not None:
            return "first_token_id cannot be combined with logprobs"
        if self.max_tokens is not None and self.max_tokens < 2:
            return "first_token_id needs max_tokens of at least 2"
        return ""
