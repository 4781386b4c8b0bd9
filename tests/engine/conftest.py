"""Shared fixtures for engine server tests: a real `ragserve engine` process on the tiny model and the openai
SDK pointed at it. A module that needs other flags (or an API key) defines its own `engine` (or `sdk`).

`smollm2_engine`: one SmolLM2-135M engine for the modules whose subject is that model's outputs (structured
outputs, tool calls); tests/conftest.py's scheduler runs those modules on one xdist worker, so it starts once."""

from __future__ import annotations

import openai
import pytest

from tests.helpers.engine_server import running_engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with running_engine(tmp_path_factory.mktemp("engine"), "--num-gpu-blocks", "256") as proc:
        yield proc


@pytest.fixture(scope="session")
def smollm2_engine(tmp_path_factory):
    args = ["--model", "smollm2-135m", "--num-gpu-blocks", "256", "--max-model-len", "1024", "--enforce-eager"]
    with running_engine(tmp_path_factory.mktemp("smollm2"), *args) as proc:
        yield proc


@pytest.fixture(scope="module")
def sdk(engine):
    with openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client
