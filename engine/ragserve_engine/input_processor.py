"""Requests as they enter the engine (vLLM's input processor): tokenized, validated against the model and the KV
cache, their sequence built (resumed or given first tokens, seeded generator, grammar state). Nothing here touches
engine state: AsyncLLM runs it off the step loop."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ragserve.engine_args import EngineConfig
from ragserve_engine.blend.spec import BlendSpec
from ragserve_engine.blend.spec import bind as bind_blend
from ragserve_engine.kv_cache_manager import KVCacheManager
from ragserve_engine.sampler import draw
from ragserve_engine.sampling_params import SamplingParams
from ragserve_engine.sequence import Request, Sequence
from ragserve_engine.structured.grammar import GrammarCompiler

if TYPE_CHECKING:
    from ragserve.tokenizer import PromptTokenizer


@dataclass
class InputProcessor:
    config: EngineConfig
    tokenizer: PromptTokenizer
    kv_manager: KVCacheManager
    grammars: GrammarCompiler
    device: torch.device
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int

    def make_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        resume_token_ids: list[int] | None = None,
        blend: BlendSpec | None = None,
        first_token_id: int | None = None,
    ) -> Request:
        """Tokenize and validate without touching engine state (safe from any thread).

        `resume_token_ids`: continue as if these output tokens had been generated already (migration);
        penalties and stop strings see them; min_tokens, max_tokens and the outputs do not.
        `first_token_id`: the answer's first token, sampled by a prefill engine (disaggregated prefill): it is
        output and counted like a sampled one, and the request continues after it.
        """
        params = params or SamplingParams()
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        resumed = list(resume_token_ids or [])
        given = resumed + ([] if first_token_id is None else [first_token_id])
        params = self._validate(token_ids, params, resumed, first_token_id)
        self.kv_manager.hash_blocks(token_ids, cache_salt)  # a salt that cannot be hashed fails here, not in a step
        seq = Sequence(token_ids + given, len(token_ids))
        if params.guided is not None:  # compiles (cached by spec): AsyncLLM calls this off the step loop
            seq.matcher = self.grammars.matcher(params.guided, given)
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(params.seed)
            if not params.greedy:
                self._fast_forward(seq.generator, len(given))
        req = Request(request_id, text, token_ids, params, [seq], priority, cache_salt)
        req.needs_fork = params.n > 1 or params.use_beam_search
        if blend is not None:
            bind_blend(req, blend)
        if first_token_id is not None:  # output already, from now: its text is the answer's start
            seq.output_text = seq.detok.step(self.tokenizer.decode, seq.output_token_ids, params.skip_special_tokens)
            req.first_token_time = time.monotonic()
        if resumed:
            req.num_resumed_tokens = len(resumed)
            req.resumed_text = self.tokenizer.decode(resumed, params.skip_special_tokens).rstrip("\ufffd")
        return req

    def _fast_forward(self, generator: torch.Generator, num_tokens: int) -> None:
        """Draw what sampling `num_tokens` tokens drew (the sampler takes one draw per token)."""
        for _ in range(num_tokens):
            draw(generator, self.device)

    def _validate(
        self, token_ids: list[int], params: SamplingParams, resumed: list[int], first: int | None
    ) -> SamplingParams:
        if not token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.vocab_size
        firsts = [] if first is None else [first]
        for name, ids in (("prompt", token_ids), ("resume_token_ids", resumed), ("first_token_id", firsts)):
            if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
                raise ValueError(f"{name} token ids must be integers in [0, {vocab})")
        if resumed and (params.n > 1 or params.use_beam_search):
            raise ValueError("resume_token_ids needs n=1 and no beam search")
        if first is not None and resumed:
            raise ValueError("resume_token_ids cannot be combined with first_token_id")
        n = len(token_ids) + len(resumed)
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens, but max_model_len is {self.max_model_len}")
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - n
        if first is not None and (why := params.continues_after_first_token()):
            raise ValueError(why)
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} exceeds "
                f"max_model_len ({self.max_model_len})"
            )
        width = max(params.n, params.beam_width if params.use_beam_search else 1)
        blocks = -(-(n + params.max_tokens) // self.block_size) * width
        if blocks > self.num_blocks:
            raise ValueError(f"request needs up to {blocks} KV blocks; the cache has {self.num_blocks}")
        if not self.config.enable_chunked_prefill and n * width > self.config.max_num_batched_tokens:
            raise ValueError(f"prompt has {n} tokens, above max_num_batched_tokens without chunked prefill")
        return params
