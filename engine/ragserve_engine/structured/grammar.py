"""Grammar compilation (cached by spec) and the per-step token bitmask over a batch's logits.

A matcher (llguidance.LLMatcher) per sequence: built when the request arrives (make_request, off the step
loop), copied on fork, advanced with every sampled token. One step fills the bitmasks of all constrained
rows in parallel (llguidance's executor, GIL released) and applies them with one masked fill.
"""

from __future__ import annotations

import functools
import threading

import llguidance
import numpy as np
import torch

from ragserve.tokenizer import PromptTokenizer
from ragserve_engine.structured.spec import JSON_FORMAT, GrammarError, GuidedDecoding

CACHE_SIZE = 256  # compiled grammars kept (by kind and spec)


class GrammarCompiler:
    def __init__(self, tokenizer: PromptTokenizer, vocab_size: int, eos_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self._source, self._eos_ids, self._lock = tokenizer, eos_ids, threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self.executor = llguidance.LLExecutor()
        self.grammar = functools.lru_cache(CACHE_SIZE)(self._compile)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """Built by the first constrained request (about 2 s for a 49k vocabulary), on its thread."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = _lltokenizer(self._source, self.vocab_size, self._eos_ids)
            return self._tokenizer

    def _compile(self, guided: GuidedDecoding) -> str:
        try:
            if guided.kind == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(guided.spec, defaults=JSON_FORMAT)
            else:
                grammar = llguidance.grammar_from(guided.kind, guided.spec)
        except (ValueError, TypeError) as exc:
            raise GrammarError(guided.param, str(exc)) from None
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if failed:
            raise GrammarError(guided.param, messages[0])
        return grammar

    def matcher(self, guided: GuidedDecoding, resumed: list[int]) -> llguidance.LLMatcher:
        """A fresh matcher, advanced past `resumed` (a migrated stream's emitted tokens)."""
        matcher = llguidance.LLMatcher(self.tokenizer, self.grammar(guided), log_level=0)
        if matcher.is_error():
            raise GrammarError(guided.param, matcher.get_error())
        if resumed and not matcher.consume_tokens(resumed):
            raise GrammarError("resume_token_ids", f"the tokens do not follow the grammar ({matcher.get_error()})")
        return matcher

    def apply(self, logits: torch.Tensor, rows: list[int], matchers: list[llguidance.LLMatcher]) -> None:
        """Mask logits[rows] in place to the tokens each matcher allows."""
        # llguidance.torch's two helpers, inlined: importing it runs a torch.compile (dynamo and inductor, ~2 s
        # of every engine start) for a kernel we do not use
        mask = torch.full((len(rows), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], mask.data_ptr(),
                                              mask.shape[1] * 4, len(rows))  # fmt: skip
        bits = np.unpackbits(mask.numpy().view(np.uint8), axis=1, bitorder="little")[:, : logits.shape[-1]]
        banned = torch.from_numpy(bits).to(logits.device) == 0
        with torch.inference_mode():  # the model's logits are inference tensors
            if rows == list(range(logits.shape[0])):  # every row constrained: in place, no gather
                logits.masked_fill_(banned, float("-inf"))
            else:
                idx = torch.tensor(rows, device=logits.device)
                logits[idx] = logits[idx].masked_fill(banned, float("-inf"))


def _lltokenizer(tokenizer: PromptTokenizer, vocab_size: int, eos_ids: list[int]) -> llguidance.LLTokenizer:
    import llguidance.hf
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.tokenizer)
    return llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos_ids)
