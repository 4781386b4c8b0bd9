"""Chat tools through a chat template that takes `tools`, on tiny engines whose tokenizers make the parser's
markers special tokens (Qwen's `<tool_call>`, Mistral's `[TOOL_CALLS]`): /tokenize shows the tools where the
template puts them (the prompt chat completions prefill), and a `required` call is forced as the marker token
and parses into tool_calls (the marker survives decoding), whole and streamed."""

from __future__ import annotations

import json
import os

import httpx
import jsonschema
import openai
import pytest
from tokenizers import AddedToken, Tokenizer

from tests.helpers.engine_server import MODEL_NAME, running_engine
from tests.helpers.tiny_models import tiny_model
from tests.helpers.tool_calls import streamed_calls

WEATHER = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
TOOLS = [{"type": "function", "function": WEATHER}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES = """{%- if tools %}<|im_start|>system
# Tools

<tools>{% for tool in tools %}{{ "\n" }}{{ tool | tojson }}{% endfor %}{{ "\n" }}</tools>

For each function call, return <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
MISTRAL = """{%- for m in messages %}{% if m.role == 'user' %}{% if loop.last and tools %}[AVAILABLE_TOOLS]\
{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST]{{ m.content }}[/INST]{% else %}{{ m.content }}{% endif %}\
{% endfor %}"""
FORMATS = {  # parser: (template, special marker tokens, where the template puts the tools)
    "hermes": (HERMES, ["<tool_call>", "</tool_call>"], "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>"),
    "mistral": (MISTRAL, ["[TOOL_CALLS]"], f"[AVAILABLE_TOOLS]{json.dumps(TOOLS)}[/AVAILABLE_TOOLS][INST]"),
}
MARKER_ID = 49152  # the first added marker: the id after SmolLM2's 49152 tokens


def tools_model(dest, parser: str):
    """A tiny Qwen2 whose tokenizer adds the parser's markers as special tokens, with a template taking tools."""
    template, markers, _ = FORMATS[parser]
    src = tiny_model("qwen2", vocab_size=MARKER_ID + len(markers))
    dest.mkdir()
    for f in src.iterdir():
        if f.name not in ("tokenizer.json", "chat_template.jinja"):
            os.symlink(f, dest / f.name)
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in markers])
    assert tok.token_to_id(markers[0]) == MARKER_ID
    tok.save(str(dest / "tokenizer.json"))
    (dest / "chat_template.jinja").write_text(template)
    return dest


@pytest.fixture(scope="module", params=sorted(FORMATS))
def engine(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    model = tools_model(tmp / "model", request.param)
    args = ["--model", str(model), "--tool-call-parser", request.param, "--num-gpu-blocks", "64", "--enforce-eager"]
    with running_engine(tmp, *args) as proc:
        proc.parser = request.param
        yield proc


def test_the_template_renders_the_tools(engine):
    body = {"model": MODEL_NAME, "messages": ASK, "tools": TOOLS}
    tokens = httpx.post(engine.url + "/tokenize", json=body, timeout=30).json()
    prompt = httpx.post(engine.url + "/detokenize", json={"tokens": tokens["tokens"]}, timeout=30).json()["prompt"]
    assert FORMATS[engine.parser][2] in prompt and "You can call these functions" not in prompt, prompt
    without = httpx.post(engine.url + "/tokenize", json={**body, "tools": None}, timeout=30).json()
    assert without["count"] < tokens["count"]
    with openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0) as sdk:
        out = sdk.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=1)
    assert out.usage.prompt_tokens == tokens["count"]  # the very prompt chat completions prefill


def test_a_required_call_is_forced_as_the_marker_token_and_parses(engine):
    kw = dict(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0)
    with openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0) as sdk:
        out = sdk.chat.completions.create(**kw, extra_body={"return_token_ids": True})
        chunks = list(sdk.chat.completions.create(**kw, stream=True))
    choice = out.choices[0]
    assert choice.model_extra["token_ids"][0] == MARKER_ID  # the special token, not its spelling
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["parameters"])
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert streamed_calls(deltas) == [("get_weather", call.function.arguments)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
