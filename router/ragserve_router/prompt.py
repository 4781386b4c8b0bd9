"""From a request body to the chained block hashes the engine will compute (shared key scheme).

Engines that registered shipped their tokenizer, so the router renders and tokenizes
exactly as they do. For engines whose tokenizer is unknown (static, Kubernetes pods
without registration) the router hashes fixed-size chunks of the prompt text instead;
those hashes only feed the approximate index.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache, partial

from ragserve.chunks import chunk_set_key, has_chunks
from ragserve.keys import root_hash
from ragserve.prefix_hashes import prefix_block_hashes
from ragserve.token_cache import Uncached
from ragserve.tokenizer import OFFLOAD_CHARS, PromptTokenizer, encode_beside_loop, normalize_messages
from ragserve_router.engines import ModelSpec
from ragserve_router.state import RouterState

log = logging.getLogger(__name__)
TEXT_CHUNK_BYTES = 64
model_root = lru_cache(maxsize=256)(root_hash)  # a model's chain root: one SHA-256, the same for every request


@dataclass
class RoutingKey:
    hashes: list[bytes]
    block_tokens: int  # tokens per hash; 0 when the hashes are of text chunks
    num_prompt_tokens: int | None = None
    chunk_tokens: tuple[int, ...] = ()  # a chunk set (docs/blend.md): hashes are chunk keys, of these lengths

    @property
    def exact(self) -> bool:
        """Hashes of the prompt's leading blocks, as the engine computes them."""
        return self.block_tokens > 0 and not self.chunk_tokens


def prompt_tokens(
    tokenizer: PromptTokenizer, body: dict, chat: bool, budget: int | None = None
) -> Sequence[int] | None:
    """Token ids exactly as the engine prefills them, or None if the prompt is not routable this way. Uncached:
    over `budget` characters of it are not in the tokenizer's cache (token_cache.py)."""
    if chat:
        messages, tools = body.get("messages"), tool_variables(body, tokenizer.chat_template or "")
        if not isinstance(messages, list) or tools is None:
            return None
        return tokenizer.encode_chat(messages, budget=budget, as_array=True, **tools)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        prompt = prompt[0]  # a batch of prompts: route on the first
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, budget=budget, as_array=True)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    return None


def active_tools(body: dict) -> list:
    """The request's tools if the engine puts them in the prompt (tools given, tool_choice not "none")."""
    tools = body.get("tools")
    return tools if isinstance(tools, list) and tools and body.get("tool_choice") != "none" else []


def tool_variables(body: dict, template: str) -> dict | None:
    """The chat template's `tools` variable as the engine fills it ({} without tools), or None where the engine
    renders them its own way: a template that does not take `tools` gets them in a system prompt of the engine's
    tool parser's format, which the router does not know (such requests are routed on text hashes)."""
    tools = active_tools(body)
    if not tools:
        return {}
    if "tools" not in template:
        return None
    return {"tools": [{"type": "function", "function": t.get("function") if isinstance(t, dict) else t} for t in tools]}


def _message_text(message: dict) -> str:
    """The message's text as the chat template sees it; parts that are not text (images) are left out."""
    content = message.get("content")
    if isinstance(content, list):
        message = {**message, "content": [p for p in content if isinstance(p, dict) and p.get("type") == "text"]}
    content = normalize_messages([message])[0].get("content")
    return content if isinstance(content, str) else json.dumps(content, sort_keys=True)


def prompt_bytes(body: dict, chat: bool) -> bytes:
    """A canonical byte form of the prompt, for text-chunk hashing."""
    if chat:
        messages = body.get("messages") if isinstance(body.get("messages"), list) else []
        parts = [f"{m.get('role', '')}\x1f{_message_text(m)}\x1e" for m in messages if isinstance(m, dict)]
        if tools := active_tools(body):  # after the messages: requests with other tools still share the context
            parts.append(f"tools\x1f{json.dumps(tools, sort_keys=True, default=str)}\x1e")
        return "".join(parts).encode("utf-8", "surrogatepass")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, list):
        return b"".join(struct.pack("<I", t & 0xFFFFFFFF) for t in prompt if isinstance(t, int))
    return str(prompt or "").encode("utf-8", "surrogatepass")


def text_hashes(data: bytes, namespace: str, cache_salt: str | None = None) -> list[bytes]:
    prev = hashlib.sha256(b"ragserve-text-v1\0" + namespace.encode() + b"\0" + (cache_salt or "").encode()).digest()
    out = []
    for i in range(len(data) // TEXT_CHUNK_BYTES):
        prev = hashlib.sha256(prev + data[i * TEXT_CHUNK_BYTES : (i + 1) * TEXT_CHUNK_BYTES]).digest()
        out.append(prev)
    return out


class Tokenizers:
    """PromptTokenizers by fingerprint, fetched from the router state and built once (off the event loop)."""

    def __init__(self, state: RouterState) -> None:
        self.state = state
        self.cache: dict[str, PromptTokenizer] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def add(self, fingerprint: str, tokenizer: PromptTokenizer) -> None:
        self.cache[fingerprint] = tokenizer

    async def get(self, fingerprint: str) -> PromptTokenizer | None:
        if fingerprint in self.cache:
            return self.cache[fingerprint]
        async with self._locks.setdefault(fingerprint, asyncio.Lock()):
            if fingerprint not in self.cache:
                try:
                    blob = await self.state.tokenizer(fingerprint)
                except Exception as exc:  # shared state down: route without token hashes for now
                    log.warning("cannot fetch tokenizer %s: %s", fingerprint, exc)
                    return None
                if blob is None:
                    return None
                tok = PromptTokenizer(blob.tokenizer_json, blob.chat_template, blob.special_tokens)
                await asyncio.to_thread(lambda: tok.cache)  # parse tokenizer.json, check the cut: once, off the loop
                self.cache[fingerprint] = tok
        return self.cache[fingerprint]

    async def routing_key(
        self, spec: ModelSpec | None, model: str, body: dict, chat: bool, size: int = 0
    ) -> RoutingKey:
        """Token block hashes when the model's tokenizer is known, else text-chunk hashes.

        `size` is the request's byte size: a body over OFFLOAD_CHARS is tokenized off the event loop, unless all
        but OFFLOAD_CHARS of it is in the tokenizer's cache (a RAG context seen before).
        """
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        tokenizer = await self.get(spec.tokenizer_fingerprint) if spec else None
        if spec and tokenizer:
            key = await encode_beside_loop(partial(token_key, tokenizer, spec, body, chat, salt), size > OFFLOAD_CHARS)
            if key is not None:
                return key
        return RoutingKey(text_hashes(prompt_bytes(body, chat), model, salt), 0)


def token_key(
    tokenizer: PromptTokenizer, spec: ModelSpec, body: dict, chat: bool, salt: str | None, budget: int | None = None
) -> RoutingKey | None:
    try:
        if chat and isinstance(body.get("messages"), list) and has_chunks(body["messages"]):  # docs/blend.md
            if budget is not None:
                raise Uncached
            chunks, num_tokens = chunk_set_key(tokenizer, body["messages"], model_root(spec.model_id), salt)
            if chunks:  # the chunk set, not the prefix
                keys, lengths = zip(*chunks, strict=True)
                return RoutingKey(list(keys), spec.block_size, num_tokens, tuple(lengths))
        tokens = prompt_tokens(tokenizer, body, chat, budget)
    except (ValueError, TypeError, AttributeError) as exc:  # the engine will answer the client about it
        log.debug("cannot tokenize request for routing: %s", exc)
        return None
    if tokens is None:
        return None
    try:
        hashes = prefix_block_hashes(tokens, spec.block_size, model_root(spec.model_id), salt)
    except ValueError:  # token ids out of range: the engine rejects the request
        hashes = []
    return RoutingKey(hashes, spec.block_size, len(tokens))
