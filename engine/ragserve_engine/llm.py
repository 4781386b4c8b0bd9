"""Offline API: LLM(model=...).generate(prompts, SamplingParams)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from ragserve.engine_args import EngineConfig
from ragserve_engine.llm_engine import LLMEngine
from ragserve_engine.outputs import RequestOutput
from ragserve_engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, loaded_model=None, **kwargs) -> None:
        """kwargs are EngineConfig fields; `loaded_model` shares weights with another LLM. The decode graphs
        compile here unless compile_at_start=False (then each size compiles in the first step that needs it)."""
        config = EngineConfig(**({"model": model} if model else {}), **kwargs)
        self.engine = LLMEngine(config, loaded_model)
        graphs = self.engine.runner.decode_graphs
        if graphs is not None and config.compile_at_start:  # the first generate() runs at full speed
            graphs.capture()
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("pass one SamplingParams, or one per prompt")
        ids = []
        for prompt, p in zip(prompts, params_list, strict=True):
            rid = f"offline-{next(self._ids)}"
            self.engine.add_request(rid, prompt, _copy(p))
            ids.append(rid)
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[rid] for rid in ids]

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        return self.generate([self.tokenizer.encode_chat(messages)], params)[0]


def _copy(params: SamplingParams) -> SamplingParams:
    from dataclasses import replace

    return replace(params, stop=list(params.stop), stop_token_ids=list(params.stop_token_ids))
