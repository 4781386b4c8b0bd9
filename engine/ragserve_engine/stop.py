"""Stop conditions after a token is appended: EOS, stop token ids, stop strings, length."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ragserve_engine.sequence import Request, Sequence

if TYPE_CHECKING:
    from ragserve.tokenizer import PromptTokenizer


@dataclass(frozen=True)
class StopCriteria:
    """What stop checks need from the engine: the tokenizer (output text), EOS ids, the context limit."""

    tokenizer: PromptTokenizer
    eos_ids: frozenset[int]
    max_model_len: int


def check_stop(req: Request, seq: Sequence, criteria: StopCriteria) -> None:
    """Resumed tokens (migration) are output for stop strings, not for min_tokens and max_tokens
    (the router sends what remains of both). The text is decoded incrementally (DetokState) and
    stop strings are searched only where a new match can be: linear in the output length."""
    p = req.params
    last = seq.token_ids[-1]
    num_new = len(seq.output_token_ids) - req.num_resumed_tokens
    decode, ids, skip = criteria.tokenizer.decode, seq.output_token_ids, p.skip_special_tokens
    if num_new >= p.min_tokens and not p.ignore_eos and last in criteria.eos_ids:
        seq.output_text = seq.detok.peek(decode, ids[:-1], skip)  # the text without the EOS token
        seq.finish_reason = "stop"
        return
    seq.output_text = seq.detok.step(decode, ids, skip)
    if num_new >= p.min_tokens:
        if last in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", last
            return
        if p.stop and _stop_string(seq, p.stop, p.include_stop_str_in_output):
            return
    if num_new >= p.max_tokens or seq.num_tokens >= criteria.max_model_len:
        seq.finish_reason = "length"


def _stop_string(seq: Sequence, stops: list[str], include: bool) -> bool:
    """The earliest match in the whole text, searching only from where the last search left off
    (less the longest stop string: a match may straddle the boundary)."""
    start = max(0, seq.detok.stop_checked - max(map(len, stops)) + 1)
    found = [(seq.output_text.find(s, start), s) for s in stops]
    found = [(i, s) for i, s in found if i >= 0]
    seq.detok.stop_checked = len(seq.detok.text)
    if not found:
        return False
    idx, stop = min(found)
    seq.output_text = seq.output_text[: idx + len(stop) if include else idx]
    seq.finish_reason, seq.stop_reason = "stop", stop
    return True
