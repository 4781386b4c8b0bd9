"""Prompt rendering and tokenization shared by engine and router (torch-free).

The router must produce exactly the token ids the engine prefills, so both use
this class, built from the same tokenizer.json and chat template.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import TypeVar

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from ragserve.token_cache import TokenCache, Uncached

ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})  # chat roles a request may use
# Prompts over this many characters (~1k tokens, ~1 ms) are tokenized on a worker thread: encode releases the GIL,
# so the event loop serves other requests meanwhile, on another core if there is one.
OFFLOAD_CHARS = 4096
T = TypeVar("T")


def long_text(prompt: object) -> bool:
    """A text prompt over OFFLOAD_CHARS: the engine and the sims tokenize it on a worker thread."""
    return isinstance(prompt, str) and len(prompt) > OFFLOAD_CHARS


def long_messages(messages: list[dict]) -> bool:
    """Chat messages whose text contents add up to over OFFLOAD_CHARS: rendered and tokenized on a worker thread."""
    return sum(len(m.get("content") or "") for m in messages) > OFFLOAD_CHARS


async def encode_beside_loop(encode: Callable[..., T], long: bool) -> T:
    """encode() on the event loop, unless `long` and over OFFLOAD_CHARS of it is not in the token cache: then on a
    worker thread (encode releases the GIL, so the loop serves others meanwhile). `encode` takes `budget=`."""
    if not long:
        return encode()
    try:
        return encode(budget=OFFLOAD_CHARS)
    except Uncached:
        return await asyncio.to_thread(encode)


def _raise(message: str):
    raise TemplateError(message)


@dataclass
class PromptTokenizer:
    tokenizer_json: str
    chat_template: str | None = None
    special_tokens: dict[str, str | None] = field(default_factory=dict)

    @cached_property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_str(self.tokenizer_json)

    @cached_property
    def _template(self):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, indent=indent, ensure_ascii=False)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template or "")

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        eos = self.special_tokens.get("eos_token")
        return self.tokenizer.token_to_id(eos) if eos else None

    @cached_property
    def cache(self) -> TokenCache:
        return TokenCache(self.tokenizer, self.tokenizer_json)

    @cached_property
    def _adds_tokens(self) -> bool:
        """Whether add_special_tokens adds any (a BOS): the cache keeps ids without them."""
        return self.tokenizer.encode("a").ids != self.tokenizer.encode("a", add_special_tokens=False).ids

    def encode(
        self, text: str, add_special_tokens: bool = True, budget: int | None = None, as_array: bool = False
    ) -> list[int] | array:
        """Raises ValueError (UnicodeEncodeError) on text that is not valid Unicode (a lone surrogate), Uncached
        where over `budget` characters would be tokenized (token_cache.py: long pieces seen before are not). The
        ids only: encode_batch_fast skips the character offsets encode() computes (a third less CPU). as_array:
        an array("I") (what keys.block_hashes packs without a copy per id)."""
        if not text.isascii():
            text.encode("utf-8")
        if add_special_tokens and self._adds_tokens:
            if budget is not None and len(text) > budget:
                raise Uncached
            ids = self.tokenizer.encode_batch_fast([text], add_special_tokens=True)[0].ids
            return array("I", ids) if as_array else ids
        return self.cache.encode(text, budget, as_array)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Apply the chat template; raises ValueError on a template error or no template."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; use /v1/completions")
        try:
            return self._template.render(
                messages=normalize_messages(messages),
                add_generation_prompt=add_generation_prompt,
                **{k: v for k, v in self.special_tokens.items() if v is not None},
                **kwargs,
            )
        except TemplateError as exc:
            raise ValueError(f"chat template error: {exc}") from None

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        budget: int | None = None,
        as_array: bool = False,
        **kwargs,
    ) -> list[int] | array:
        """kwargs: further template variables (a chat's `tools`); `budget` and `as_array` as for encode."""
        text = self.render_chat(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False, budget=budget, as_array=as_array)

    def fingerprint(self) -> str:
        digest = hashlib.sha256(self.tokenizer_json.encode())
        digest.update(b"\0" + (self.chat_template or "").encode())
        digest.update(b"\0" + json.dumps(self.special_tokens, sort_keys=True).encode())
        return digest.hexdigest()[:24]

    @classmethod
    def from_dir(cls, path: str | Path) -> PromptTokenizer:
        """Load tokenizer.json, tokenizer_config.json and chat_template.jinja from a directory."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json")
        config = {}
        if (path / "tokenizer_config.json").is_file():
            config = json.loads((path / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        specials = {k: _token_str(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        return cls((path / "tokenizer.json").read_text(), template, specials)


def normalize_messages(messages: list[dict]) -> list[dict]:
    """OpenAI content given as a list of text parts becomes one string (what chat templates expect).

    Raises ValueError on a role outside ROLES."""
    out = []
    for message in messages:
        if message.get("role") not in ROLES:
            role = str(message.get("role"))[:40]
            raise ValueError(f"unknown chat role {role!r}; use one of {', '.join(sorted(ROLES))}")
        content = message.get("content")
        if isinstance(content, list):
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise ValueError("only text content parts are supported")
            message = {**message, "content": "".join(p.get("text") or "" for p in content)}
        out.append(message)
    return out


def _token_str(value) -> str | None:
    if isinstance(value, dict):  # AddedToken serialized form
        return value.get("content")
    return value
