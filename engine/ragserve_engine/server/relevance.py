"""Rerank and score on a generation engine: the model's probability that a document is relevant to a query.

Each (query, document) pair is the fixed RELEVANCE_SYSTEM / "Query: ...\\nDocument: ..." chat rendered with the
model's chat template, assistant turn opened (as LLM rerankers such as Qwen3-Reranker prompt). One step through
the engine (max_tokens 1, so continuous batching and prefix caching apply: the pairs share the system prefix)
returns the logprobs of the tokens "yes" and "no" (each the first id of the word encoded alone, no leading
space); the score is p(yes) / (p(yes) + p(no)).
"""

from __future__ import annotations

import math
import uuid

import numpy as np
from fastapi import Request

from ragserve_engine.engine_client import EngineError, RequestError, SamplingParams
from ragserve_engine.server.errors import bad_request, failure
from ragserve_engine.server.generation import Generation
from ragserve_engine.server.serving_base import collect
from ragserve_engine.server.tools import tool_request
from ragserve_engine.server.transport import until_disconnect

RELEVANCE_SYSTEM = 'Judge whether the Document is relevant to the Query. Answer only "yes" or "no".'


def relevance_messages(query: str, document: str) -> list[dict]:
    return [
        {"role": "system", "content": RELEVANCE_SYSTEM},
        {"role": "user", "content": f"Query: {query}\nDocument: {document}"},
    ]


def yes_no_ids(tokenizer) -> tuple[int, int]:
    """The token ids whose probabilities are compared: "yes" and "no", each encoded alone."""
    yes, no = (tokenizer.encode(word, add_special_tokens=False)[0] for word in ("yes", "no"))
    return yes, no


def relevance(logprobs: dict[int, float], yes: int, no: int) -> float:
    """p(yes) / (p(yes) + p(no)), computed stably from the two logprobs."""
    return 1.0 / (1.0 + math.exp(logprobs[no] - logprobs[yes]))


async def relevance_scores(
    server, request: Request, left: list[str], right: list[str], field: str
) -> tuple[np.ndarray, list[list[int]]]:
    """The relevance of each right[i] to left[i], and the prompts' token ids."""
    llm, no_tools = server.llm, tool_request(None, None)
    prompts = [server.chat.encode(relevance_messages(q, d), no_tools) for q, d in zip(left, right, strict=True)]
    yes, no = yes_no_ids(llm.tokenizer)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0, logprob_token_ids=[yes, no])
    gen = Generation(server, prompts, params, f"score-{uuid.uuid4().hex}")
    try:
        await until_disconnect(request, gen.start())
        finals = await until_disconnect(request, collect(gen))
    except ValueError as exc:
        raise bad_request(exc, field) from None
    except (RequestError, EngineError) as exc:
        raise failure(exc) from None
    scores = [relevance(finals[i].outputs[0].logprobs[0], yes, no) for i in range(len(prompts))]
    return np.asarray(scores, dtype=np.float64), prompts
