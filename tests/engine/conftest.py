"""Shared fixtures for engine server tests: a real `ragserve engine` process on the tiny model and the openai
SDK pointed at it. A module that needs other flags (or an API key) defines its own `engine` (or `sdk`)."""

from __future__ import annotations

import openai
import pytest

from tests.helpers.engine_server import running_engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with running_engine(tmp_path_factory.mktemp("engine"), "--num-gpu-blocks", "256") as proc:
        yield proc


@pytest.fixture(scope="module")
def sdk(engine):
    with openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client
