"""The sim engine's steps follow the engine's per-step prefill cap and long-prompt turns (prefill_policy.py): what
`--long-prefill-token-threshold` and `--max-long-partial-prefills` do to first tokens, on a SimEngine in process."""

from __future__ import annotations

import asyncio

from ragserve.model_source import load_tokenizer, resolve_model
from ragserve_engine.engine_client import SamplingParams
from ragserve_engine.sim.engine import SimCost, SimEngine
from ragserve_engine.sim.fleet import kv_layout
from tests.helpers.tiny_models import tiny_model

LONG_A, LONG_B, SHORT = list(range(100, 700)), list(range(1000, 1600)), list(range(2000, 2012))


def first_token_work(cap: int, limit: int) -> dict[str, int]:
    """Prompt tokens the sim had computed when each request got its first token: a, b and a short one together."""
    source = resolve_model(str(tiny_model("llama")))
    cost = SimCost(prefill_tokens_per_s=1e6, decode_base_s=0.001, decode_seq_s=0.0)
    sim = SimEngine(load_tokenizer(source), kv_layout(source, 16), 256, cost, max_num_batched_tokens=256,
                    long_prefill_token_threshold=cap, max_long_partial_prefills=limit)  # fmt: skip
    first: dict[str, int] = {}

    async def one(rid: str, prompt: list[int]) -> None:
        async for _ in sim.generate(prompt, SamplingParams(max_tokens=2, ignore_eos=True), rid):
            first.setdefault(rid, sim.computed_prompt_tokens)

    async def run() -> None:
        await asyncio.gather(one("a", LONG_A), one("b", LONG_B), one("short", SHORT))

    asyncio.run(run())
    return first


def test_long_prompts_take_turns_under_the_cap_and_a_short_one_passes():
    turns = first_token_work(64, 1)
    assert turns["short"] == 64 + len(SHORT)  # its first step, beside a's first capped chunk; b waits its turn
    assert turns["a"] <= 600 + 12 + 64 < turns["b"]  # a's 600 tokens first, then b's
    shared = first_token_work(64, 0)
    assert shared["a"] > 1100 and shared["b"] > 1100  # without the limit both share every step
    whole = first_token_work(0, 1)  # no cap: the limit has nothing to act on, the short prompt waits out both
    assert whole["short"] == 600 + 600 + len(SHORT)
