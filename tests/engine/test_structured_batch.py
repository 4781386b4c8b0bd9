"""A grammar-constrained request in a batch leaves its neighbours' greedy tokens unchanged (SmolLM2-135M,
in-process engine: the batch is exactly the requests given)."""

from __future__ import annotations

import json

from ragserve_engine.llm import LLM
from ragserve_engine.sampling_params import SamplingParams
from ragserve_engine.structured.spec import GuidedDecoding

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
QUESTIONS = ["What is the capital of France?", "Name a colour.", "Is water wet? Answer in JSON."]


def test_constrained_neighbours_do_not_change_greedy_tokens():
    llm = LLM("smollm2-135m", num_gpu_blocks=128, enforce_eager=True)
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    guided = GuidedDecoding.json_schema(SCHEMA, "guided_json")
    greedy_json = SamplingParams(temperature=0, max_tokens=24, guided=guided)
    sampled_json = SamplingParams(temperature=1.0, seed=2, n=2, max_tokens=24, guided=guided)
    alone = llm.generate(prompts[:2], plain)
    mixed = llm.generate(prompts + [prompts[2]], [plain, plain, greedy_json, sampled_json])
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]
    unconstrained = llm.generate(prompts[2], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0].text
    answers = [c.text for o in mixed[2:] for c in o.outputs]
    assert all(json.loads(a)["answer"] in ("yes", "no") for a in answers), answers
    assert unconstrained not in answers  # the grammar did steer it
