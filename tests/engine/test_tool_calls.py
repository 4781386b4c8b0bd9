"""Chat tools on a real SmolLM2-135M engine (its template takes no tools: the fallback system prompt) with the
openai SDK: `required` and a named tool_choice always parse into tool_calls whose arguments validate against the
function's schema, whole and streamed (piecewise, as vLLM streams them); bad tools are 400s naming the
field. The three parsers' formats are checked against their own forcing grammars (llguidance, SmolLM2's
tokenizer), and each parser streams a call's arguments piecewise."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from ragserve.model_source import load_tokenizer, resolve_model
from ragserve_engine.server.tool_parsers import PARSERS
from ragserve_engine.server.tools import ToolRequest, ToolStream
from ragserve_engine.structured.grammar import GrammarCompiler
from ragserve_engine.structured.spec import GuidedDecoding
from tests.helpers.engine_server import MODEL_NAME
from tests.helpers.openai_errors import assert_400
from tests.helpers.openai_errors import post_chat as post
from tests.helpers.tool_calls import streamed_calls

SEARCH = {
    "name": "search_passages",
    "description": "Search the document store",
    "parameters": {
        "type": "object",
        "properties": {"query": {"type": "string", "maxLength": 24}, "top_k": {"type": "integer", "minimum": 1,
                                                                                 "maximum": 10}},
        "required": ["query", "top_k"],
        "additionalProperties": False,
    },
}  # fmt: skip
WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
TOOLS = [{"type": "function", "function": f} for f in (SEARCH, WEATHER)]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {f["name"]: f["parameters"] for f in (SEARCH, WEATHER)}


@pytest.fixture(scope="module")
def engine(smollm2_engine):
    return smollm2_engine


@pytest.fixture(scope="module")
def sdk(engine):
    with openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0, timeout=300) as client:
        yield client


def check_calls(calls, names: set[str]) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_parse_with_valid_arguments(sdk, choice):
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    names = {"search_passages", "get_weather"} if choice == "required" else {"get_weather"}
    kw = dict(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=80)
    out = sdk.chat.completions.create(**kw, n=2, temperature=1.0, seed=5)
    for c in out.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        check_calls(c.message.tool_calls, names)
    chunks = list(sdk.chat.completions.create(**kw, temperature=0, stream=True))
    whole = sdk.chat.completions.create(**kw, temperature=0).choices[0].message.tool_calls
    check_calls(whole, names)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not "".join(d.content or "" for d in deltas)
    assert streamed_calls(deltas) == [(whole[0].function.name, whole[0].function.arguments)]


def test_tool_choice_none_and_a_conversation_with_tool_results(sdk):
    out = sdk.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8,
                                      temperature=0)  # fmt: skip
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]  # fmt: skip
    out = sdk.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop", "tool_calls")


BAD = [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
]


@pytest.mark.parametrize(("extra", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_tools_are_400s_naming_the_field(engine, extra, param):
    assert_400(post(engine, {"model": MODEL_NAME, "messages": ASK, "max_tokens": 4, **extra}), param)


@pytest.fixture(scope="module")
def grammars():
    tok = load_tokenizer(resolve_model("smollm2-135m"))
    return tok, GrammarCompiler(tok, tok.vocab_size, [tok.eos_token_id])


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_each_parser_reads_what_its_grammar_forces(grammars, name):
    tok, compiler = grammars
    parser = PARSERS[name]()
    call = {"function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo", "unit": "c"})}}
    text = parser.format_calls([call])
    matcher = compiler.matcher(GuidedDecoding("lark", parser.forced_grammar([SEARCH, WEATHER]), "tool_choice"), [])
    assert matcher.consume_tokens(tok.encode(text, add_special_tokens=False)) and matcher.is_accepting(), text
    prefix = "" if name == "llama3_json" else "Let me check. "  # llama3: a call is the whole answer
    content, calls = parser.extract(prefix + text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo", "unit": "c"})]
    assert content == (prefix.strip() or None)
    assert parser.extract("No call here.") == ("No call here.", [])
    ids = tok.encode(prefix + text, add_special_tokens=False)  # streamed token by token, as the server does
    stream, pieces = ToolStream(parser, ToolRequest([SEARCH, WEATHER], "auto")), []
    for k in range(len(ids)):
        done = k == len(ids) - 1
        pieces.append(stream.feed(tok.decode(ids[: k + 1])[len(stream.text) :], done))
    assert "".join(text for text, _ in pieces) == prefix
    first, *rest = [entry for _, entries in pieces for entry in entries]
    assert first["function"] == {"name": "get_weather", "arguments": ""} and first["id"].startswith("call_")
    assert len(rest) > 1 and "".join(e["function"]["arguments"] for e in rest) == calls[0].arguments
