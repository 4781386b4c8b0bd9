"""One streamed RAG chat request through the router, measured: TTFT, tokens, cached tokens, engine."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import httpx

from ragserve.chunks import CHUNK_FIELD

SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer the user's question using only the context below. "
    "If the context does not contain the answer, say so. Be brief."
)


def rag_messages(title: str, context: str, question: str, chunks: list[str] = ()) -> list[dict]:
    """The context goes first (system message), the question last: every question on a context shares its KV.

    With `chunks`, each passage is a chunk content part of the user message instead (docs/blend.md)."""
    if chunks:
        parts = [{"type": "text", "text": f"Context ({title}):\n"}]
        for text in chunks:
            parts += [{"type": "text", "text": text, CHUNK_FIELD: True}, {"type": "text", "text": "\n\n"}]
        parts.append({"type": "text", "text": question})
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": parts}]
    system = f"{SYSTEM_PROMPT}\n\nContext ({title}):\n{context}"
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def json_answer(passage_ids: list[str], max_tokens: int) -> tuple[str, dict, int]:
    """(system prompt addition, response_format, max_tokens): a JSON answer whose citations are the context's
    passage ids. The answer gets about max_tokens tokens of text (3 characters each); the request's own
    max_tokens leaves room for the whole JSON (a string character costs at most ~1 token, the ids and keys
    too), so the answer is not cut by the limit before it closes."""
    answer_chars = 3 * max_tokens
    schema = {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "maxLength": answer_chars},
            "cited_passages": {"type": "array", "items": {"enum": passage_ids}, "maxItems": len(passage_ids)},
        },
        "required": ["answer", "cited_passages"],
        "additionalProperties": False,
    }
    hint = f"Answer in JSON; cite the passages you used by id. Passage ids, in context order: {', '.join(passage_ids)}"
    skeleton = len(json.dumps({"answer": "", "cited_passages": passage_ids}))
    response_format = {"type": "json_schema", "json_schema": {"name": "cited_answer", "schema": schema, "strict": True}}
    return hint, response_format, 2 * (answer_chars + skeleton)


def check_json_answer(text: str, passage_ids: list[str]) -> tuple[dict | None, str]:
    """(the parsed answer, "") or (None, why it is not a valid cited answer)."""
    try:
        answer = json.loads(text)
    except ValueError as exc:
        return None, f"the answer is not JSON ({exc}): {text[:200]!r}"
    if not isinstance(answer, dict) or not isinstance(answer.get("answer"), str):
        return None, f"the answer has no 'answer' string: {text[:200]!r}"
    cited = answer.get("cited_passages")
    if not isinstance(cited, list) or not set(cited) <= set(passage_ids):
        return None, f"'cited_passages' {cited!r} is not a list of the context's passage ids {passage_ids}"
    return answer, ""


@dataclass
class ChatResult:
    status: int = 0
    text: str = ""
    engine: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None  # first content token
    latency_s: float = 0.0
    finish_reason: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    def to_dict(self) -> dict:
        return asdict(self)


async def stream_chat(
    client: httpx.AsyncClient, url: str, body: dict, headers: dict[str, str] | None = None
) -> ChatResult:
    """POST {url}/v1/chat/completions with stream=True and usage; never raises for HTTP or network errors."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    result = ChatResult()
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
            result.status = resp.status_code
            result.engine = resp.headers.get("x-ragserve-engine", "")
            if resp.status_code != 200:
                result.error = _error_message(await resp.aread())
                return result
            async for line in resp.aiter_lines():
                if _consume(line, result) and result.ttft_s is None:
                    result.ttft_s = time.perf_counter() - t0
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.latency_s = time.perf_counter() - t0
    return result


def _consume(line: str, result: ChatResult) -> bool:
    """Apply one SSE line to result; True if it carried the output of a decode step (text or a finish)."""
    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
        return False
    chunk = json.loads(line[5:])
    if chunk.get("error"):
        result.error = chunk["error"].get("message", str(chunk["error"]))
        return False
    if usage := chunk.get("usage"):
        result.prompt_tokens = usage.get("prompt_tokens", 0)
        result.completion_tokens = usage.get("completion_tokens", 0)
        result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
    choices = chunk.get("choices") or []
    text = "".join((c.get("delta") or {}).get("content") or "" for c in choices)
    result.text += text
    result.finish_reason = next((c["finish_reason"] for c in choices if c.get("finish_reason")), result.finish_reason)
    return bool(text) or any(c.get("finish_reason") for c in choices)


def _error_message(raw: bytes) -> str:
    try:
        return json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return raw.decode("utf-8", "replace")[:500]
