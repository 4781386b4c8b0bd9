"""Token ids of long prompt pieces, kept: a RAG prompt's documents come back again and again, and tokenizing a
3k-token document costs ~3 ms of CPU, in the router and again in the engine, on every request.

The tokenizer splits its input at added tokens before it normalizes and pre-tokenizes the text between them, so a
prompt cut at a special token that only ever matches itself (not stripped, not normalized, inside no other added
token) tokenizes to its pieces' ids, concatenated. A chat template puts such tokens between messages, so a RAG
prompt's context (its own message) is one piece. Pieces of MIN_CHARS or more are kept, the least recently used
dropped first past CAPACITY_CHARS. The cut is checked against a whole encode when the cache is built; a tokenizer
for which it differs is never cut.
"""

from __future__ import annotations

import json
import re
import threading
from array import array
from collections import OrderedDict

from tokenizers import Tokenizer

MIN_CHARS = 1024  # shorter pieces cost less to tokenize than to keep
CAPACITY_CHARS = 8 << 20  # ~8 MiB of text and 4 bytes a token beside it
SHORT_PIECES = 1024  # ...but a template's own short pieces ("\n", "assistant\n") come back in every prompt
_PROBE = " a{t} b\n{t}\n\n c  {t}x{t}{t} \t{t}\u00e9{t}"  # the token against spaces, newlines, letters, itself


class Uncached(Exception):
    """More of the text is not cached than the caller would tokenize here (encode's `budget`)."""


class TokenCache:
    """encode(text) == tokenizer.encode(text, add_special_tokens=False).ids, cutting at special tokens and keeping
    long pieces' ids. Safe to call from several threads."""

    def __init__(self, tokenizer: Tokenizer, tokenizer_json: str, capacity_chars: int = CAPACITY_CHARS) -> None:
        self.tokenizer, self.capacity_chars = tokenizer, capacity_chars
        self.ids = _cut_tokens(tokenizer, tokenizer_json)
        self.split = re.compile("(" + "|".join(map(re.escape, self.ids)) + ")") if self.ids else None
        self._entries: OrderedDict[str, array] = OrderedDict()
        self._short: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._chars = self.hits = self.misses = 0  # long pieces found, and tokenized
        self._lock = threading.Lock()
        if self.split and self.encode(probe := _probe(self.ids)) != self._whole(probe):
            self.ids, self.split = {}, None
        self._entries.clear()
        self._short.clear()
        self._chars = self.hits = self.misses = 0

    @property
    def chars(self) -> int:
        """Characters of text whose ids are kept."""
        return self._chars

    def encode(self, text: str, budget: int | None = None, as_array: bool = False) -> list[int] | array:
        """The ids of `text` (as_array: an array("I"), no int objects); Uncached when over `budget` characters of it
        would have to be tokenized."""
        if self.split is None or len(text) < MIN_CHARS:
            ids = self._checked_whole(text, budget)
            return array("I", ids) if as_array else ids
        pieces = self.split.split(text)  # text, special token, text, ...
        parts: list = [None] * len(pieces)
        todo = []
        for i, piece in enumerate(pieces):
            if i % 2:
                parts[i] = (self.ids[piece],)
            elif piece and (found := self._get(piece)) is not None:
                parts[i] = found
            elif piece:
                todo.append(i)
        if budget is not None and sum(len(pieces[i]) for i in todo) > budget:
            raise Uncached
        if todo:
            encoded = self.tokenizer.encode_batch_fast([pieces[i] for i in todo], add_special_tokens=False)
            for i, enc in zip(todo, encoded, strict=True):
                parts[i] = enc.ids
                self._put(pieces[i], enc.ids)
        ids = array("I")
        for part in parts:
            if part is not None:
                ids += part if isinstance(part, array) else array("I", part)
        return ids if as_array else ids.tolist()

    def _checked_whole(self, text: str, budget: int | None) -> list[int]:
        if budget is not None and len(text) > budget:
            raise Uncached
        return self._whole(text)

    def _whole(self, text: str) -> list[int]:
        return self.tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def _get(self, piece: str) -> array | tuple[int, ...] | None:
        with self._lock:
            if len(piece) < MIN_CHARS:
                if (found := self._short.get(piece)) is not None:
                    self._short.move_to_end(piece)
                return found
            found = self._entries.get(piece)
            if found is not None:
                self._entries.move_to_end(piece)
                self.hits += 1
            return found

    def _put(self, piece: str, ids: list[int]) -> None:
        with self._lock:
            if len(piece) < MIN_CHARS:
                self._short[piece] = tuple(ids)
                if len(self._short) > SHORT_PIECES:
                    self._short.popitem(last=False)
                return
            self.misses += 1
            if piece in self._entries or len(piece) > self.capacity_chars:
                return
            self._entries[piece] = array("I", ids)
            self._chars += len(piece)
            while self._chars > self.capacity_chars:
                old, _ = self._entries.popitem(last=False)
                self._chars -= len(old)


def _cut_tokens(tokenizer: Tokenizer, tokenizer_json: str) -> dict[str, int]:
    """The special tokens a text can be cut at: matched as they are (not normalized, stripped or single-word only)
    and inside no other added token; none where the whole text is truncated or padded."""
    if tokenizer.truncation or tokenizer.padding:  # they apply to the whole text, not to its pieces
        return {}
    added = json.loads(tokenizer_json).get("added_tokens") or []
    contents = [a.get("content") or "" for a in added]
    cut = {}
    for a in added:
        t = a.get("content") or ""
        plain = not (a.get("normalized") or a.get("lstrip") or a.get("rstrip") or a.get("single_word"))
        alone = sum(t in other for other in contents) == 1
        if t and a.get("special") and plain and alone and (token_id := tokenizer.token_to_id(t)) is not None:
            cut[t] = token_id
    return cut


def _probe(tokens: dict[str, int]) -> str:
    """One text with every cut token in it (a tokenizer may have hundreds), long enough to take the cut path."""
    filler = "word " * (MIN_CHARS // 5 + 1)
    return filler + "".join(_PROBE.format(t=t) for t in tokens) + filler
