"""The unmodified `openai` SDK against the router and real engines (chat, completions, streaming, models, errors)."""

from __future__ import annotations

import openai
import pytest

from tests.helpers import process

KEY = "sk-sdk-test"


@pytest.fixture(scope="module")
def client(fleet, module_cluster):
    keys = module_cluster.tmp / "sdk-keys.txt"
    keys.write_text(KEY + "\n")
    urls = ",".join(e.url for e in fleet.engines[:2])
    router = module_cluster.router("--static-engines", urls, "--api-keys-file", str(keys), "--probe-interval", "0.5")
    sdk = openai.OpenAI(base_url=router.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    process.until(lambda: [m.id for m in sdk.models.list()] == ["tiny"], what="engines probed")
    yield sdk, router
    sdk.close()


def test_models_and_chat(client):
    sdk, _ = client
    assert [m.id for m in sdk.models.list()] == ["tiny"]
    raw = sdk.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "Say hi"}], max_tokens=2
    )
    assert raw.headers["x-ragserve-engine"] in {"static-0", "static-1"}
    completion = raw.parse()
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 2
    assert completion.usage.prompt_tokens > 0 and completion.model == "tiny"


def test_streaming_chat_with_usage(client):
    sdk, _ = client
    stream = sdk.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Say hi"}],
        max_tokens=4,
        extra_body={"ignore_eos": True},
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


def test_streaming_completions(client):
    sdk, _ = client
    stream = sdk.completions.create(model="tiny", prompt="Once", max_tokens=4, stream=True)
    pieces = [c.choices[0].text for c in stream]
    assert "".join(pieces) and len(pieces) >= 2  # streamed piece by piece


def test_sdk_raises_typed_errors(client):
    sdk, router = client
    with pytest.raises(openai.NotFoundError) as info:
        sdk.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert info.value.code == "model_not_found"
    bad = openai.OpenAI(base_url=router.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
