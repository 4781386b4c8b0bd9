"""Jump-forward decoding: the tokens a grammar forces are appended unsampled and computed with the next step.
Greedy output is token for token what plain masked decoding gives (each forced token is the only one the mask
allows), in fewer steps; max_tokens still cuts where it did; unconstrained neighbours are untouched."""

from __future__ import annotations

import json

import pytest

from ragserve_engine.llm import LLM
from ragserve_engine.sampling_params import SamplingParams
from ragserve_engine.structured.spec import GuidedDecoding
from tests.helpers.tiny_models import tiny_model

SCHEMA = {
    "type": "object",
    "properties": {
        "customer_account_identifier": {"type": "integer", "minimum": 0, "maximum": 999},
        "shipping_destination_country_code": {"enum": ["US", "FR", "DE"]},
        "requires_signature_on_delivery": {"type": "boolean"},
    },
    "required": ["customer_account_identifier", "shipping_destination_country_code", "requires_signature_on_delivery"],
    "additionalProperties": False,
}
PROMPTS = ["Describe an order as JSON:", "Order record:"]


@pytest.fixture(scope="module")
def llms():
    on = LLM(str(tiny_model("llama")), enforce_eager=True, num_gpu_blocks=128)
    off = LLM(str(tiny_model("llama")), loaded_model=on.engine.runner.model, enforce_eager=True, num_gpu_blocks=128,
              enable_jump_forward=False)  # fmt: skip
    return on, off


def run(llm: LLM, params: list[SamplingParams], prompts: list[str]) -> tuple[list[list[int]], int]:
    """Each request's output token ids and the number of engine steps the batch took."""
    ids = [f"jf-{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        llm.engine.add_request(rid, prompt, p)
    done, steps = {}, 0
    while llm.engine.has_unfinished_requests():
        steps += 1
        done |= {o.request_id: o for o in llm.engine.step() if o.finished}
    return [done[rid].outputs[0].token_ids for rid in ids], steps


def guided(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, guided=GuidedDecoding.json_schema(SCHEMA, "x"))


def test_greedy_tokens_match_masked_decoding_in_fewer_steps(llms):
    on, off = llms
    params = [guided(200), SamplingParams(max_tokens=40, temperature=0.0)]  # a constrained and a plain request
    (jumped, plain_on), steps_on = run(on, params, PROMPTS)
    (masked, plain_off), steps_off = run(off, params, PROMPTS)
    assert jumped == masked and plain_on == plain_off
    assert json.loads(on.tokenizer.decode(jumped))["shipping_destination_country_code"] in ("US", "FR", "DE")
    constrained_on = run(on, [guided(200)], PROMPTS[:1])[1]
    constrained_off = run(off, [guided(200)], PROMPTS[:1])[1]
    assert constrained_on < constrained_off - 10  # the three long keys cost a step each, not one per token
    assert steps_on <= steps_off


@pytest.mark.parametrize("max_tokens", [1, 3, 9])
def test_max_tokens_cuts_forced_tokens_where_masked_decoding_does(llms, max_tokens):
    on, off = llms
    jumped, masked = run(on, [guided(max_tokens)], PROMPTS[:1])[0], run(off, [guided(max_tokens)], PROMPTS[:1])[0]
    assert jumped == masked and len(jumped[0]) == max_tokens
