"""--long-prefill-token-threshold (vLLM's): one long prefill takes at most that many tokens a step, so a short
prompt queued behind a cold long one gets its first token within a step or two
instead of after the whole long prefill; outputs are unchanged."""

from __future__ import annotations

import pytest

from ragserve_engine.llm import LLM
from ragserve_engine.sampling_params import SamplingParams
from tests.helpers.tiny_models import tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
LONG, SHORT = list(range(100, 700)), list(range(900, 912))


@pytest.fixture(scope="module")
def model():
    return LLM(str(tiny_model("llama")), num_gpu_blocks=128, compile_at_start=False).engine.runner.model


def first_token_steps(model, threshold: int) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Steps until each request's first token, and the outputs; the short prompt arrives after step 1."""
    llm = LLM(str(tiny_model("llama")), loaded_model=model, num_gpu_blocks=128, max_num_batched_tokens=256,
              long_prefill_token_threshold=threshold, compile_at_start=False)  # fmt: skip
    engine = llm.engine
    engine.add_request("long", LONG, GREEDY)
    first, outputs, step = {}, {}, 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            first.setdefault(out.request_id, step) if out.outputs[0].token_ids else None
            outputs[out.request_id] = out.outputs[0].token_ids
        if step == 1:
            engine.add_request("short", SHORT, GREEDY)
    return first, outputs


def test_a_short_prompt_is_not_held_behind_a_long_prefill(model):
    before, expected = first_token_steps(model, 0)
    assert before == {"long": 3, "short": 3}  # 600 tokens at 256 a step: the short one waits them out
    after, outputs = first_token_steps(model, 64)
    assert after["short"] == 2  # admitted next to a capped chunk of the long prompt
    assert after["long"] > before["long"]  # the long prompt pays a few more (cheaper) steps
    assert outputs == expected


def test_the_threshold_is_validated():
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        LLM(str(tiny_model("llama")), num_gpu_blocks=16, long_prefill_token_threshold=-1)


def test_the_threshold_holds_with_nobody_waiting(model):
    """vLLM's semantics: the cap applies to every step, so a prompt arriving during a cold prefill waits for at
    most one capped chunk, not for a step spending the whole budget on the cold one."""
    llm = LLM(str(tiny_model("llama")), loaded_model=model, num_gpu_blocks=128, max_num_batched_tokens=256,
              long_prefill_token_threshold=64, compile_at_start=False)  # fmt: skip
    llm.engine.add_request("long", LONG, GREEDY)
    steps = 0
    while not any(out.outputs[0].token_ids for out in llm.engine.step()):
        steps += 1
    assert steps + 1 == -(-len(LONG) // 64)  # 600 tokens in chunks of 64, alone in the engine


def first_token_work(model, limit: int, priority: bool = False, arrivals=()) -> tuple[dict, dict]:
    """Prompt tokens the engine had computed when each request got its first token (work, not steps: a capped
    step is cheaper), and the outputs. `arrivals`: (after step, request id, prompt, priority) added later."""
    policy = "priority" if priority else "fcfs"
    llm = LLM(str(tiny_model("llama")), loaded_model=model, num_gpu_blocks=256, max_num_batched_tokens=256,
              long_prefill_token_threshold=64, max_long_partial_prefills=limit, scheduling_policy=policy,
              compile_at_start=False)  # fmt: skip
    engine, later = llm.engine, {step: (rid, prompt, prio) for step, rid, prompt, prio in arrivals}
    engine.add_request("a", LONG, GREEDY, priority=1)
    engine.add_request("b", OTHER_LONG, GREEDY, priority=1)
    first, outputs, step = {}, {}, 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            if out.outputs[0].token_ids:
                first.setdefault(out.request_id, engine.stats().computed_prompt_tokens)
            outputs[out.request_id] = out.outputs[0].token_ids
        if step in later:
            rid, prompt, prio = later[step]
            engine.add_request(rid, prompt, GREEDY, priority=prio)
    return first, outputs


OTHER_LONG = list(range(1000, 1600))


def test_long_prompts_are_prefilled_one_after_another(model):
    """--max-long-partial-prefills 1 (the default): two cold prompts queued together take turns, so the first gets
    its first token after its own 600 tokens, not after both; without the limit they share every step."""
    shared, expected = first_token_work(model, 0)
    assert shared["a"] > 1100 and shared["b"] > 1100  # each waited out both prompts
    turns, outputs = first_token_work(model, 1)
    assert turns["a"] <= 600 + 64 and turns["b"] <= shared["b"]
    assert outputs == expected


def test_a_short_prompt_passes_a_long_one_waiting_its_turn(model):
    first, _ = first_token_work(model, 1, arrivals=[(2, "short", SHORT, 1)])
    assert first["short"] < first["a"] < first["b"]
    assert first["short"] <= 3 * 64 + len(SHORT)  # a step or so after it arrived, beside a's capped chunk


def test_a_higher_priority_long_prompt_does_not_wait_for_a_lower_ones_turn(model):
    """Under --scheduling-policy priority the limit counts the long prefills of its priority or higher only."""
    first, _ = first_token_work(model, 1, priority=True, arrivals=[(2, "urgent", list(range(2000, 2300)), 0)])
    assert first["urgent"] < first["a"]  # started at once, not after a's 600 tokens
    assert first["urgent"] <= 2 * 64 + 300 + 5 * 64  # its 300 tokens beside a's capped chunks


def test_the_long_prefill_limit_is_validated():
    with pytest.raises(ValueError, match="max_long_partial_prefills"):
        LLM(str(tiny_model("llama")), num_gpu_blocks=16, max_long_partial_prefills=-1)
