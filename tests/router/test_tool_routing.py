"""Chat requests with `tools`, routed: the engine renders the tools into the prompt, so the router must too, or its
block hashes are not the engine's (predicted hits that are not there, real ones it cannot see).

A template that takes `tools` (as Llama 3's and Qwen's do): the router passes them to it exactly as the engine does,
and its predicted cached tokens equal the engine's real ones. A template that does not (the tiny model's, SmolLM2's):
the engine writes them into a system prompt of its tool parser's format, which the router does not know, so the
request is routed on text hashes that include the tools, never on token hashes that leave them out."""

from __future__ import annotations

import httpx
import pytest

from ragserve.tokenizer import PromptTokenizer
from ragserve_router.engines import ModelSpec
from ragserve_router.prompt import token_key
from tests.router.conftest import Cluster, registered

TOOLS_PREAMBLE = "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
DOCS = [" ".join(f"tool-doc{d} fact{i} is {i * 5 % 13}." for i in range(50)) for d in range(2)]


def tool(name: str) -> dict:
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    return {"type": "function", "function": {"name": name, "description": f"Look {name} up.", "parameters": params}}


def chat(doc: int, question: str, tools: list[dict], **extra) -> dict:
    messages = [{"role": "system", "content": f"Context:\n{DOCS[doc]}"}, {"role": "user", "content": question}]
    return {"model": "tiny", "messages": messages, "tools": tools, "max_tokens": 2, **extra}


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory, model_dir):
    """The tiny model with a chat template that takes `tools` (its weights and tokenizer linked, not copied)."""
    out = tmp_path_factory.mktemp("tools-model")
    for f in model_dir.iterdir():
        if f.name != "chat_template.jinja":
            (out / f.name).symlink_to(f)
    (out / "chat_template.jinja").write_text(TOOLS_PREAMBLE + (model_dir / "chat_template.jinja").read_text())
    return out


@pytest.fixture(scope="module")
def tool_fleet(tmp_path_factory, tools_model):
    c = Cluster(tmp_path_factory.mktemp("tool-fleet"), tools_model)
    router = c.router("--heartbeat-interval-ms", "300", name="tool-router")
    engines = c.real_engines(router, 2, "--num-gpu-blocks", "512", ids=["tools-0", "tools-1"])
    for engine in engines:
        c.wait_registered(engine)
    assert registered(router) == 2
    yield router
    c.stop_all()


def post(router, body: dict) -> httpx.Response:
    resp = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp


def test_tools_in_the_template_are_hashed_as_the_engine_renders_them(tool_fleet, metrics, until):
    router = tool_fleet
    total = lambda name: metrics.total(router.url, f"ragserve_router_{name}_cached_tokens_total")  # noqa: E731
    stored = lambda: metrics(router.url, "ragserve_router_kv_events_total", kind="stored")  # noqa: E731
    cases = [(0, [tool("weather")], {}), (1, [tool("weather"), tool("time")], {}), (0, [tool("time")], {})]
    cases.append((1, [tool("weather")], {"tool_choice": "none"}))  # no tools rendered, by the engine or the router
    for doc, tools, extra in cases:
        before = stored()
        first = post(router, chat(doc, "First?", tools, **extra))
        until(lambda b=before: stored() > b, message="the engine's KV events reached the router")
        predicted, actual = total("predicted"), total("actual")
        for q in range(2):
            resp = post(router, chat(doc, f"Q{q}?", tools, **extra))
            usage = resp.json()["usage"]
            assert resp.headers["x-ragserve-engine"] == first.headers["x-ragserve-engine"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 32
        assert total("actual") - actual > 0
        assert total("predicted") - predicted == total("actual") - actual  # the router's hashes are the engine's


def test_tools_the_template_does_not_take_route_on_text(prompt_tokenizer):
    spec = ModelSpec(model_id="tiny@test", block_size=16, tokenizer_fingerprint="fp")
    plain = chat(0, "First?", [])
    with_tools = chat(0, "First?", [tool("weather")])
    assert token_key(prompt_tokenizer, spec, plain, True, None).exact
    assert token_key(prompt_tokenizer, spec, with_tools, True, None) is None  # the engine's system prompt: unknown
    assert token_key(prompt_tokenizer, spec, {**with_tools, "tool_choice": "none"}, True, None).exact
    template = TOOLS_PREAMBLE + prompt_tokenizer.chat_template
    takes = PromptTokenizer(prompt_tokenizer.tokenizer_json, template, prompt_tokenizer.special_tokens)
    keyed, bare = token_key(takes, spec, with_tools, True, None), token_key(takes, spec, plain, True, None)
    assert keyed.exact and keyed.num_prompt_tokens > bare.num_prompt_tokens and keyed.hashes[0] != bare.hashes[0]
