"""Incremental detokenization: each step decodes only a short window of the newest tokens.

vLLM's prefix/read offsets: the text of ids[prefix:read] is known; decoding ids[prefix:] and
dropping that known text gives the new text. One token of context before the new ones keeps
decoders that treat a sequence's first token specially (SentencePiece's leading space) right.
A window that ends in an incomplete UTF-8 character ("\\ufffd") is kept pending until it completes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

Decode = Callable[[list[int], bool], str]


@dataclass
class DetokState:
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""  # decoded text of ids[:read_offset]
    stop_checked: int = 0  # characters of text already searched for stop strings

    def _window(self, decode: Decode, ids: list[int], skip: bool) -> str:
        """The text that ids[read_offset:] add, possibly ending in an incomplete character."""
        known = decode(ids[self.prefix_offset : self.read_offset], skip)
        full = decode(ids[self.prefix_offset :], skip)
        return full[len(known) :] if len(full) > len(known) else ""

    def step(self, decode: Decode, ids: list[int], skip: bool) -> str:
        """The output text of ids (as one decode of them would give); commits it unless it ends
        in an incomplete character."""
        new = self._window(decode, ids, skip)
        if not new or new.endswith("\ufffd"):
            return self.text + new
        self.text += new
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return self.text

    def peek(self, decode: Decode, ids: list[int], skip: bool) -> str:
        """The output text of ids (at least what step last committed) without committing it."""
        return self.text + self._window(decode, ids, skip)

    def copy(self) -> DetokState:
        return DetokState(self.prefix_offset, self.read_offset, self.text, self.stop_checked)
