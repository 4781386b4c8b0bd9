"""The router tokenizes a prompt over OFFLOAD_CHARS on a worker thread (encode releases the GIL: the event loop
routes other requests meanwhile) and a shorter one on the loop; the routing key is the same either way."""

from __future__ import annotations

import asyncio
import threading

import pytest

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

    def recorded(*args):
        threads.append(threading.current_thread())
        return token_key(*args)

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
        return loop, offloaded, inline, chat

    loop, offloaded, inline, chat = asyncio.run(main())
    assert threads[0] is not loop and threads[1] is loop and threads[2] is not loop
    assert offloaded.hashes == inline.hashes and offloaded.num_prompt_tokens == inline.num_prompt_tokens
    assert len(offloaded.hashes) == offloaded.num_prompt_tokens // 16 > 0 and chat.hashes
