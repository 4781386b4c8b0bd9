"""The unmodified `openai` SDK against the router (chat, completions, streaming, models, errors)."""

from __future__ import annotations

import time

import openai
import pytest

KEY = "sk-sdk-test"


@pytest.fixture(scope="module")
def client(module_cluster):
    keys = module_cluster.tmp / "sdk-keys.txt"
    keys.write_text(KEY + "\n")
    router = module_cluster.router("--heartbeat-interval-ms", "300", "--api-keys-file", str(keys))
    for i in range(2):
        module_cluster.engine(f"sdk-{i}", router=router)
    sdk = openai.OpenAI(base_url=router.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    for _ in range(100):
        if [m.id for m in sdk.models.list()] == ["tiny"]:
            break
        time.sleep(0.1)
    yield sdk, router
    sdk.close()


def test_models_and_chat(client):
    sdk, _ = client
    assert [m.id for m in sdk.models.list()] == ["tiny"]
    raw = sdk.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "Say hi"}], max_tokens=2
    )
    assert raw.headers["x-ragserve-engine"] in {"sdk-0", "sdk-1"}
    completion = raw.parse()
    assert completion.choices[0].message.content and completion.usage.prompt_tokens > 0


def test_streaming_chat_with_usage(client):
    sdk, _ = client
    stream = sdk.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Say hi"}],
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 0


def test_streaming_completions(client):
    sdk, _ = client
    pieces = [c.choices[0].text for c in sdk.completions.create(model="tiny", prompt="Once", stream=True)]
    assert "".join(pieces)


def test_sdk_raises_typed_errors(client):
    sdk, router = client
    with pytest.raises(openai.NotFoundError) as info:
        sdk.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert info.value.code == "model_not_found"
    bad = openai.OpenAI(base_url=router.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
