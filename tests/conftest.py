"""Shared fixtures. Servers bind to 127.0.0.1 on free ports and are stopped by the test."""

import os

import pytest

from tests.helpers.net import free_port

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def port() -> int:
    return free_port()
