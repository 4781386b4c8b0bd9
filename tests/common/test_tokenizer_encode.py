"""PromptTokenizer.encode (encode_batch_fast: ids without offsets) gives exactly the ids of Tokenizer.encode, the
tokenizers library's full encoding, on the SmolLM2 tokenizer the tiny test models carry."""

from __future__ import annotations

import pytest

from ragserve.tokenizer import PromptTokenizer
from tests.helpers.tiny_models import tiny_model

TEXTS = [
    "",
    "Hi",
    "  leading and trailing spaces  ",
    "<|im_start|>user\nWhat is PagedAttention?<|im_end|>\n<|im_start|>assistant\n",
    "Überraschung! 東京の天気は? naïve café — emoji 😁 and tabs\tand\r\nnewlines",
    "def f(x):\n    return x ** 2  # code\n" * 40,
    "The KV cache of each retrieved document is computed once per cluster. " * 200,
]


@pytest.fixture(scope="module")
def tok() -> PromptTokenizer:
    return PromptTokenizer.from_dir(tiny_model("llama"))


@pytest.mark.parametrize("special", [True, False])
@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_encode_matches_the_full_encoding(tok: PromptTokenizer, text: str, special: bool) -> None:
    assert tok.encode(text, add_special_tokens=special) == tok.tokenizer.encode(text, add_special_tokens=special).ids


def test_lone_surrogate_is_a_value_error(tok: PromptTokenizer) -> None:
    with pytest.raises(ValueError):
        tok.encode("broken \ud800 text")
