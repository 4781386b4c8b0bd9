"""The router tokenizes a prompt over OFFLOAD_CHARS on a worker thread (encode releases the GIL: the event loop
routes other requests meanwhile) and a shorter one on the loop, as it does a long one whose long pieces the
tokenizer's cache holds (a RAG context seen before, token_cache.py); the routing key is the same either way."""

from __future__ import annotations

import asyncio
import threading

import pytest

from ragserve.keys import block_hashes
from ragserve.tokenizer import OFFLOAD_CHARS, PromptTokenizer
from ragserve_router import prompt
from ragserve_router.engines import ModelSpec
from ragserve_router.prompt import Tokenizers
from tests.helpers.tiny_models import tiny_model


@pytest.fixture(scope="module")
def tokenizers() -> Tokenizers:
    t = Tokenizers(state=None)
    t.add("fp", PromptTokenizer.from_dir(tiny_model("llama")))
    return t


def test_long_prompts_tokenize_off_the_loop_with_the_same_key(tokenizers: Tokenizers, monkeypatch) -> None:
    threads: list[threading.Thread] = []
    token_key = prompt.token_key

    def recorded(*args, **kw):
        key = token_key(*args, **kw)
        threads.append(threading.current_thread())  # where a key was made (an Uncached try on the loop is not)
        return key

    monkeypatch.setattr(prompt, "token_key", recorded)
    spec = ModelSpec("m", 16, "fp")
    long_body = {"model": "m", "prompt": "cluster " * (OFFLOAD_CHARS // 8 + 10)}
    messages = [{"role": "user", "content": "Which engine holds this document? " * 150}]
    chat_body = {"model": "m", "messages": messages}

    async def main():
        loop = threading.current_thread()
        size = len(long_body["prompt"])
        offloaded = await tokenizers.routing_key(spec, "m", long_body, False, size)
        inline = await tokenizers.routing_key(spec, "m", long_body, False, 0)  # as if the body were small
        chat = await tokenizers.routing_key(spec, "m", chat_body, True, OFFLOAD_CHARS + 1)
        follow_up = {"model": "m", "messages": [*messages, {"role": "user", "content": "And the next one?"}]}
        cached = await tokenizers.routing_key(spec, "m", follow_up, True, OFFLOAD_CHARS + 1)
        return loop, offloaded, inline, chat, cached

    loop, offloaded, inline, chat, cached = asyncio.run(main())
    assert threads[0] is not loop and threads[1] is loop and threads[2] is not loop and threads[3] is loop
    assert offloaded.hashes == inline.hashes and offloaded.num_prompt_tokens == inline.num_prompt_tokens
    assert len(offloaded.hashes) == offloaded.num_prompt_tokens // 16 > 0 and chat.hashes
    tok = tokenizers.cache["fp"]
    rendered = tok.render_chat([*messages, {"role": "user", "content": "And the next one?"}])
    whole = tok.tokenizer.encode(rendered, add_special_tokens=False).ids
    assert cached.num_prompt_tokens == len(whole) and cached.hashes[: len(chat.hashes) - 1] == chat.hashes[:-1]
    assert cached.hashes == block_hashes(whole, 16, prompt.model_root("m"))
