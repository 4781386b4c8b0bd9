"""Request bodies of an embedding engine (`--task embed`): OpenAI's /v1/embeddings, the Cohere/Jina-style
/v1/rerank that vLLM and smg accept, and vLLM's /v1/score. Inputs are checked here, each bad one a 400 naming
its field; unknown fields are ignored like OpenAI does."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ragserve.http.errors import ApiError
from ragserve_engine.server.protocol import ApiRequest

MAX_INPUTS = 2048  # OpenAI's limit on one embeddings request's inputs (and on rerank documents)


def is_ids(value: Any) -> bool:
    ints = isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    return ints and bool(value)


def invalid(message: str, field: str) -> ApiError:
    return ApiError(400, message, "invalid_value", field)


def texts_or_ids(value: Any, field: str) -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids or a list of such lists, as a list of inputs."""
    if isinstance(value, str) or is_ids(value):
        value = [value]
    if not isinstance(value, list) or not value:
        kinds = "a string, a list of strings, a list of token ids or a list of such lists"
        raise invalid(f"{field} must be {kinds}", field)
    if len(value) > MAX_INPUTS:
        raise invalid(f"{field} has {len(value)} inputs; at most {MAX_INPUTS}", field)
    for item in value:
        if not (isinstance(item, str) and item) and not is_ids(item):
            raise invalid(f"each {field} must be a non-empty string or a non-empty list of token ids", field)
    return value


class PoolingRequest(ApiRequest):
    model: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)  # keep each input's first k tokens
    add_special_tokens: bool = True  # vLLM's: the tokenizer's [CLS]/[SEP] or BOS around text inputs


class EmbeddingRequest(PoolingRequest):
    input: list[str | list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _input(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if "input" not in data:
                raise invalid("input is required", "input")
            data = {**data, "input": texts_or_ids(data["input"], "input")}
        return data


class RerankDocument(ApiRequest):
    text: str


class RerankRequest(PoolingRequest):
    query: str = Field(min_length=1)
    documents: list[str | RerankDocument] = Field(min_length=1, max_length=MAX_INPUTS)
    top_n: int | None = Field(default=None, ge=0)  # None or 0: every document
    return_documents: bool = True

    @field_validator("documents")
    @classmethod
    def _texts(cls, documents: list) -> list:
        if any(not (d if isinstance(d, str) else d.text) for d in documents):
            raise ValueError("documents must be non-empty strings (or objects with a non-empty text)")
        return documents

    @property
    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ScoreRequest(PoolingRequest):
    text_1: str | list[str]
    text_2: str | list[str]

    @model_validator(mode="after")
    def _pairs(self) -> ScoreRequest:
        for name in ("text_1", "text_2"):
            texts = getattr(self, name)
            texts = [texts] if isinstance(texts, str) else texts
            if not texts or len(texts) > MAX_INPUTS or not all(texts):
                raise invalid(f"{name} must be a non-empty string or 1 to {MAX_INPUTS} non-empty strings", name)
        if isinstance(self.text_1, list) and len(self.text_1) not in (1, len(self.pairs_right)):
            raise invalid("text_1 must be one text, or as many texts as text_2", "text_1")
        return self

    @property
    def pairs_right(self) -> list[str]:
        return [self.text_2] if isinstance(self.text_2, str) else self.text_2

    @property
    def pairs_left(self) -> list[str]:
        left = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        return left * len(self.pairs_right) if len(left) == 1 else left
