"""Stop checks decode incrementally: the same texts and stops as one whole decode per step, with a
number of decoded tokens linear in the output length (the whole output each step was quadratic)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from ragserve.model_source import load_tokenizer, resolve_model
from ragserve_engine.sampling_params import SamplingParams
from ragserve_engine.sequence import Request, Sequence
from ragserve_engine.stop import StopCriteria, check_stop

# multi-byte characters that byte-level BPE splits across tokens, spaces, newlines, digits
TEXT = "Héllo wörld! 你好，世界 🙂👍🏽 naïve café\n\n  indented:\tx = 42 → ∑ résumé " * 6


@dataclass
class CountingTokenizer:
    inner: object
    decoded_tokens: int = 0

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded_tokens += len(token_ids)
        return self.inner.decode(token_ids, skip_special_tokens)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model("smollm2-135m"))


def generate(tok, ids: list[int], params: SamplingParams, prompt: tuple[int, ...] = (1, 2, 3), resumed: int = 0):
    """Feed ids one per step through check_stop as the engine does; the texts after each step."""
    counter = CountingTokenizer(tok)
    criteria = StopCriteria(counter, frozenset({tok.eos_token_id}), 10_000)
    seq = Sequence([*prompt, *ids[:resumed]], len(prompt))
    req = Request("r", None, list(prompt), params, [seq], num_resumed_tokens=resumed)
    texts = []
    for t in ids[resumed:]:
        seq.token_ids.append(t)
        check_stop(req, seq, criteria)
        texts.append(seq.output_text)
        if seq.finished:
            break
    return seq, texts, counter.decoded_tokens


def test_texts_equal_a_whole_decode_with_linear_decoding(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert len(ids) > 250
    seq, texts, decoded = generate(tok, ids, SamplingParams(max_tokens=len(ids), ignore_eos=True))
    assert texts == [tok.decode(ids[: i + 1]) for i in range(len(ids))]  # incomplete characters included
    assert seq.output_text == TEXT and seq.finish_reason == "length"
    assert decoded <= 8 * len(ids)  # a whole decode per step: len * (len + 1) / 2 tokens


def test_stop_strings_match_a_whole_text_search(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    full = tok.decode(ids)
    for stop, include in [("世界", False), ("ld! 你", True), ("👍🏽", False), ("\n\n  ind", True), ("∑ r", False)]:
        seq, _, _ = generate(tok, ids, SamplingParams(max_tokens=len(ids), stop=[stop, "never there"],
                                                      include_stop_str_in_output=include))  # fmt: skip
        end = full.index(stop) + (len(stop) if include else 0)
        assert (seq.finish_reason, seq.stop_reason, seq.output_text) == ("stop", stop, full[:end])
        assert tok.decode(seq.output_token_ids).startswith(full[: full.index(stop) + len(stop)])
        assert not tok.decode(seq.output_token_ids[:-1]).count(stop)  # stopped at the first token completing it
    # a stop string seen while min_tokens held the checks off still stops at the first check after
    first = full.index("wörld")
    min_tokens = next(i for i in range(len(ids)) if len(tok.decode(ids[:i])) > first + 20)
    seq, _, _ = generate(tok, ids, SamplingParams(max_tokens=len(ids), min_tokens=min_tokens, stop=["wörld"]))
    assert seq.output_text == full[:first] and len(seq.output_token_ids) == min_tokens
    # resumed tokens (migration) are searched too
    seq, _, _ = generate(tok, ids, SamplingParams(max_tokens=50, stop=["你好"]), resumed=20)
    assert seq.output_text == full[: full.index("你好")] and len(seq.output_token_ids) == 21


def test_eos_text_fork_and_special_tokens(tok):
    ids = tok.encode("one two three four", add_special_tokens=False) + [tok.eos_token_id]
    for skip in (True, False):
        seq, texts, _ = generate(tok, ids, SamplingParams(max_tokens=20, skip_special_tokens=skip))
        assert seq.finish_reason == "stop" and seq.output_text == "one two three four"
    seq, _, _ = generate(tok, ids[:2], SamplingParams(max_tokens=20))
    child = seq.fork()
    criteria = StopCriteria(tok, frozenset(), 10_000)
    req = Request("r", None, [1, 2, 3], SamplingParams(max_tokens=20), [seq, child])
    for s, extra in ((seq, ids[2:4]), (child, tok.encode(" café 🙂", add_special_tokens=False))):
        for t in extra:
            s.token_ids.append(t)
            check_stop(req, s, criteria)
        assert s.output_text == tok.decode(s.output_token_ids)
    assert seq.output_text != child.output_text
