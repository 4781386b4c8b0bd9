"""Chat prompts with chunks: retrieved documents marked for blending (docs/blend.md). Torch-free.

A chunk is a text content part carrying `"ragserve_chunk": true`. The chat is rendered with a
placeholder per chunk; the text around the placeholders and each chunk are tokenized apart, so a
chunk's token ids never depend on its neighbours and its KV can be reused wherever it appears.
Engine and router both tokenize chunked chats here.
"""

from __future__ import annotations

import hashlib
import re
import struct
from dataclasses import dataclass

from ragserve.keys import chunk_key
from ragserve.tokenizer import PromptTokenizer

CHUNK_FIELD = "ragserve_chunk"
_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters: no template or document produces them
_PLACEHOLDER = re.compile(f"{_OPEN}([0-9]+){_CLOSE}")


@dataclass
class ChunkedPrompt:
    token_ids: list[int]
    spans: list[tuple[int, int]]  # [start, end) of each non-empty chunk in token_ids, in prompt order

    def chunk_tokens(self) -> list[list[int]]:
        return [self.token_ids[a:b] for a, b in self.spans]


class ChunkPartError(ValueError):
    """A content part marked wrongly; `param` is the dotted path of what is wrong (messages.1.content.0...)."""

    def __init__(self, param: str, detail: str) -> None:
        super().__init__(f"{param}: {detail}")
        self.param = param
        self.detail = detail


def has_chunks(messages: list[dict]) -> bool:
    """Whether any content part is a chunk; raises ChunkPartError naming the first bad part: a marker that
    is not a boolean, a chunk on a part that is not text, chunk text holding the placeholder characters."""
    found = False
    for i, message in enumerate(messages):
        for j, part in enumerate(_parts(message)):
            found = _is_chunk(part, f"messages.{i}.content.{j}") or found
    return found


def _is_chunk(part, path: str) -> bool:
    marker = part.get(CHUNK_FIELD, False) if isinstance(part, dict) else False
    if not isinstance(marker, bool):
        raise ChunkPartError(f"{path}.{CHUNK_FIELD}", "must be true or false")
    if marker and part.get("type") != "text":
        raise ChunkPartError(path, f"{CHUNK_FIELD} marks text parts only, this part's type is {part.get('type')!r}")
    text = (part.get("text") or "") if marker else ""
    if _OPEN in text or _CLOSE in text:
        raise ChunkPartError(f"{path}.text", "chunk text must not contain U+E000 or U+E001")
    return marker


def encode_chunked_chat(tokenizer: PromptTokenizer, messages: list[dict]) -> ChunkedPrompt:
    """Token ids of the chat and where its chunks are; raises ValueError on a template or content error
    (ChunkPartError on a badly marked part)."""
    has_chunks(messages)
    texts: list[str] = []

    def placeholder(part: dict) -> dict:
        if not part.get(CHUNK_FIELD):
            return part
        texts.append(part.get("text") or "")
        return {"type": part.get("type"), "text": f"{_OPEN}{len(texts) - 1}{_CLOSE}"}

    marked = [{**m, "content": [placeholder(p) for p in m["content"]]} if _parts(m) else m for m in messages]
    pieces = _PLACEHOLDER.split(tokenizer.render_chat(marked))
    if [int(i) for i in pieces[1::2]] != list(range(len(texts))):
        raise ValueError("the chat template must keep every chunk content part, once and in order")
    token_ids: list[int] = []
    spans: list[tuple[int, int]] = []
    for j, piece in enumerate(pieces):
        ids = tokenizer.encode(piece if j % 2 == 0 else texts[int(piece)], add_special_tokens=False) if piece else []
        if j % 2 == 1 and ids:
            spans.append((len(token_ids), len(token_ids) + len(ids)))
        token_ids += ids
    return ChunkedPrompt(token_ids, spans)


def chunk_set_key(
    tokenizer: PromptTokenizer, messages: list[dict], root: bytes, cache_salt: str | None = None
) -> tuple[list[tuple[bytes, int]], int]:
    """The router's key for a chunked chat: its chunks' (content key, token count), sorted by key (any order
    is the same set), and the prompt's token count."""
    prompt = encode_chunked_chat(tokenizer, messages)
    chunks = {chunk_key(root, t, (), cache_salt): len(t) for t in prompt.chunk_tokens()}
    return sorted(chunks.items()), len(prompt.token_ids)


def chunk_record_keys(key: bytes, num_tokens: int, block_size: int) -> list[bytes]:
    """A chunk's cachestore records: ceil(num_tokens / block_size) keys SHA-256(chunk key | u32le(i))."""
    return [hashlib.sha256(key + struct.pack("<I", i)).digest() for i in range(-(-num_tokens // block_size))]


def _parts(message: dict) -> list:
    content = message.get("content")
    return content if isinstance(content, list) else []
