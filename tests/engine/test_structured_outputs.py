"""Structured outputs on a real SmolLM2-135M engine process, driven by the openai SDK: json_schema
(strict) answers over a set of schemas all validate with jsonschema, streamed and not, with n = 4;
guided_choice / guided_regex / guided_grammar; resume and prefix caching; bad grammars are 400s naming the field.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.helpers.engine_server import MODEL_NAME
from tests.helpers.openai_errors import assert_400
from tests.helpers.openai_errors import post_chat as post

ASK = [{"role": "user", "content": "Describe a city as JSON."}]
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "location": {
                "type": "object",
                "properties": {"country": {"type": "string", "maxLength": 12}, "coastal": {"type": "boolean"}},
                "required": ["country", "coastal"],
                "additionalProperties": False,
            },
        },
        "required": ["city", "location"],
        "additionalProperties": False,
    },
    "enum_and_bounds": {
        "type": "object",
        "properties": {
            "size": {"enum": ["small", "medium", "large"]},
            "population": {"type": "integer", "minimum": 1000, "maximum": 99999},
            "rating": {"type": "number", "minimum": 0, "maximum": 5},
        },
        "required": ["size", "population", "rating"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "districts": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
            "ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 4},
        },
        "required": ["districts", "ids"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def engine(smollm2_engine):
    return smollm2_engine


def response_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def streamed_texts(chunks) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    return texts


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_every_json_schema_answer_validates(sdk, stream):
    for name, schema in SCHEMAS.items():
        kw = dict(model=MODEL_NAME, messages=ASK, n=4, temperature=1.0, seed=7, max_tokens=96)
        out = sdk.chat.completions.create(**kw, response_format=response_format(name), stream=stream)
        if stream:
            texts = streamed_texts(out)
        else:
            texts = {c.index: c.message.content for c in out.choices}
            assert {c.finish_reason for c in out.choices} == {"stop"}, name
        assert sorted(texts) == [0, 1, 2, 3]
        for text in texts.values():
            jsonschema.validate(json.loads(text), schema)  # raises on any invalid answer
        assert len(set(texts.values())) > 1, name  # each sequence sampled on its own, under its own matcher


def test_json_object_and_guided_json_on_completions(sdk):
    out = sdk.completions.create(model=MODEL_NAME, prompt="A JSON object describing a cat:", max_tokens=64,
                                 temperature=0, extra_body={"guided_json": SCHEMAS["enum_and_bounds"]})  # fmt: skip
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMAS["enum_and_bounds"])
    chat = sdk.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=64, temperature=0,
                                       response_format={"type": "json_object"})  # fmt: skip
    assert isinstance(json.loads(chat.choices[0].message.content), dict)


def test_guided_choice_regex_and_grammar(sdk):
    ask = [{"role": "user", "content": "Is the sky green? Answer yes or no."}]
    choice = sdk.chat.completions.create(model=MODEL_NAME, messages=ask, max_tokens=8, temperature=1.0, n=4,
                                         seed=3, extra_body={"guided_choice": ["yes", "no", "maybe"]})  # fmt: skip
    assert {c.message.content for c in choice.choices} <= {"yes", "no", "maybe"}
    regex = r"[A-Z][a-z]{2,6} [0-9]{2}"
    out = sdk.completions.create(model=MODEL_NAME, prompt="A code name:", max_tokens=12, temperature=0.8, seed=1,
                                 stream=True, extra_body={"guided_regex": regex})  # fmt: skip
    assert re.fullmatch(regex, "".join(c.choices[0].text for c in out))
    grammar = 'start: "Answer: " ("red" | "blue") "."'
    out = sdk.completions.create(model=MODEL_NAME, prompt="Pick a colour.", max_tokens=8, temperature=0,
                                 extra_body={"guided_grammar": grammar})  # fmt: skip
    assert out.choices[0].text in ("Answer: red.", "Answer: blue.")


def test_prefix_cached_and_resumed_requests_keep_the_grammar(engine):
    body = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 64, "temperature": 0, "return_token_ids": True,
            "response_format": response_format("nested")}  # fmt: skip
    first = post(engine, body).json()
    again = post(engine, body).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    whole = first["choices"][0]
    assert again["choices"][0]["message"]["content"] == whole["message"]["content"]
    ids = whole["token_ids"]
    resumed = post(engine, {**body, "resume_token_ids": ids[:5], "max_tokens": 64 - 5}).json()["choices"][0]
    assert resumed["token_ids"] == ids[5:]  # the matcher was rebuilt from the emitted tokens
    assert whole["message"]["content"].endswith(resumed["message"]["content"])
    off = post(engine, {**body, "resume_token_ids": [28, 28, 28]})  # not JSON: the grammar refuses them
    assert_400(off, "resume_token_ids")


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_regex": "a+", "use_beam_search": True, "n": 2}, "use_beam_search"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_grammars_and_combinations_are_400s_naming_the_field(engine, extra, param):
    assert_400(post(engine, {"model": MODEL_NAME, "messages": ASK, "max_tokens": 4, **extra}), param)


@pytest.fixture(scope="module")
def sdk(engine):
    with openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0, timeout=300) as client:
        yield client
