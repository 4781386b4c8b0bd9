"""/v1/embeddings of an embedding engine (`--task embed`, a PoolingClient); /v1/rerank and /v1/score of every
engine (one request parsing and answer; only pair_scores differs).

On an embedding engine rerank and score are bi-encoder scores: the cosine similarity of the query's (text_1's)
and each document's (text_2's) embeddings, as vLLM scores with an embedding model (no cross-encoder ships on
PyPI to run offline). On a generation engine they are the model's probability of relevance (relevance.py).
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse

from ragserve.http.errors import ApiError
from ragserve_engine.engine_client import PoolingClient
from ragserve_engine.server.errors import failure
from ragserve_engine.server.pooling_protocol import (
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    invalid,
)
from ragserve_engine.server.relevance import relevance_scores
from ragserve_engine.server.transport import ClientDisconnected, until_disconnect

TOKENIZE_OFF_LOOP = 16  # inputs: more are tokenized on a worker thread


class PoolingServing:
    def __init__(self, server) -> None:  # the EngineServer (it holds this)
        self.server = server

    @property
    def llm(self) -> PoolingClient:
        return self.server.llm

    async def embeddings(self, request: Request, req: EmbeddingRequest) -> JSONResponse:
        dims = self._dimensions(req.dimensions)
        prompts = await self.tokenize(req, req.input, "input")
        vectors = await self.run(request, req, prompts, "embd")
        if dims is not None:
            vectors = vectors[:, :dims]
            if self.llm.pooling.normalize:
                vectors = vectors / np.linalg.norm(vectors, axis=1, keepdims=True).clip(min=1e-12)
        data = [
            {"object": "embedding", "index": i, "embedding": _encode(v, req.encoding_format)}
            for i, v in enumerate(vectors)
        ]
        body = self._header("embd", "list") | {"data": data, "usage": _usage(prompts)}
        return JSONResponse(body)

    async def rerank(self, request: Request, req: RerankRequest) -> JSONResponse:
        texts = req.texts
        scores, prompts = await self.pair_scores(request, req, [req.query] * len(texts), texts, "documents")
        order = sorted(range(len(texts)), key=lambda i: -scores[i])[: req.top_n or None]
        results = []
        for i in order:
            result = {"index": i, "relevance_score": float(scores[i])}
            if req.return_documents:
                result["document"] = {"text": texts[i]}
            results.append(result)
        usage = {"total_tokens": sum(map(len, prompts))}
        return JSONResponse(self._header("rerank") | {"results": results, "usage": usage})

    async def score(self, request: Request, req: ScoreRequest) -> JSONResponse:
        scores, prompts = await self.pair_scores(request, req, req.pairs_left, req.pairs_right, "text_1")
        data = [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(scores)]
        return JSONResponse(self._header("score", "list") | {"data": data, "usage": _usage(prompts)})

    async def pair_scores(
        self, request: Request, req: PoolingRequest, left: list[str], right: list[str], field: str
    ) -> tuple[np.ndarray, list[list[int]]]:
        """How relevant right[i] is to left[i], and the prompts run: on a generation engine the model's
        probability of relevance (relevance.py), on an embedding engine the cosine of the two embeddings."""
        if not self.server.embeds:
            return await relevance_scores(self.server, request, left, right, field)
        distinct = list(dict.fromkeys(left + right))  # a shared query / text_1 is embedded once
        prompts = await self.tokenize(req, distinct, field)
        vectors = await self.run(request, req, prompts, "score")
        at = {text: i for i, text in enumerate(distinct)}
        scores = _cosine(vectors[[at[t] for t in left]], vectors[[at[t] for t in right]])
        return scores, prompts

    # ---- shared steps -------------------------------------------------------------------------------
    def _dimensions(self, dims: int | None) -> int | None:
        info = self.llm.pooling
        if dims is None or dims == info.hidden_size:
            return None
        if not info.matryoshka:
            raise invalid(
                f"this model's embeddings have {info.hidden_size} dimensions and it was not trained to be cut "
                "shorter (matryoshka); omit dimensions", "dimensions",
            )  # fmt: skip
        if dims > info.hidden_size:
            raise invalid(f"dimensions must be at most {info.hidden_size}", "dimensions")
        return dims

    async def tokenize(self, req: PoolingRequest, inputs: list, field: str) -> list[list[int]]:
        """Token ids of every input, each checked against the vocabulary and max_model_len."""
        texts = [x for x in inputs if isinstance(x, str)]
        if len(texts) > TOKENIZE_OFF_LOOP:
            encoded = await asyncio.to_thread(self._encode_texts, req, texts)
        else:
            encoded = self._encode_texts(req, texts)
        it = iter(encoded)
        prompts = [next(it) if isinstance(x, str) else list(x[: req.truncate_prompt_tokens]) for x in inputs]
        vocab, limit = self.llm.tokenizer.vocab_size, self.llm.pooling.max_model_len
        for ids in prompts:
            if any(t < 0 or t >= vocab for t in ids):
                raise invalid(f"token ids must be in [0, {vocab})", field)
            if len(ids) > limit:
                raise ApiError(
                    400, f"an input has {len(ids)} tokens, over this model's max_model_len {limit}; shorten it or "
                    "set truncate_prompt_tokens", "context_length_exceeded", field,
                )  # fmt: skip
        return prompts

    def _encode_texts(self, req: PoolingRequest, texts: list[str]) -> list[list[int]]:
        tok = self.llm.tokenizer.tokenizer
        try:
            encodings = tok.encode_batch(texts, add_special_tokens=False)
        except Exception as exc:  # tokenizers raises plain Exceptions (e.g. on lone surrogates)
            raise invalid(f"cannot tokenize the input: {exc}", "input") from None
        keep = req.truncate_prompt_tokens
        out = []
        for enc in encodings:
            specials = tok.num_special_tokens_to_add(False) if req.add_special_tokens else 0
            if keep is not None:
                enc.truncate(max(1, keep - specials))
            if req.add_special_tokens:
                enc = tok.post_process(enc)
            out.append(enc.ids)
        return out

    async def run(self, request: Request, req: PoolingRequest, prompts: list[list[int]], kind: str) -> np.ndarray:
        server = self.server
        server.check_model(req.model)
        started = time.monotonic()
        server.inflight += 1
        try:
            vectors = await until_disconnect(request, self.llm.embed(prompts, f"{kind}-{uuid.uuid4().hex}"))
        except (ApiError, ClientDisconnected, asyncio.CancelledError):
            raise
        except Exception as exc:
            raise failure(exc) from None
        finally:
            server.inflight -= 1
        metrics = server.metrics
        metrics.prompt_tokens.labels(server.model_name).inc(sum(map(len, prompts)))
        metrics.request_success.labels(server.model_name, "stop").inc()
        metrics.e2e.labels(server.model_name).observe(time.monotonic() - started)
        return np.asarray(vectors, dtype=np.float32)

    def _header(self, kind: str, obj: str | None = None) -> dict:
        head = {"id": f"{kind}-{uuid.uuid4().hex}", "model": self.server.model_name, "created": int(time.time())}
        return head | ({"object": obj} if obj else {})


def _encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # OpenAI's: the little-endian float32 bytes
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()


def _usage(prompts: list[list[int]]) -> dict:
    tokens = sum(map(len, prompts))
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of a[i] with b[i]."""
    a = a / np.linalg.norm(a, axis=1, keepdims=True).clip(min=1e-12)
    b = b / np.linalg.norm(b, axis=1, keepdims=True).clip(min=1e-12)
    return (a * b).sum(1)
