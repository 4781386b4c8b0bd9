"""Shared fixtures. Servers bind to 127.0.0.1 on free ports and are stopped by the test."""

import os

import pytest

from tests.helpers.net import free_port

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engine processes the tests start run eager (no inductor compile at start-up or in the background): a
# compiling engine takes ~12 s to be ready instead of ~3 s and keeps a core busy afterwards. The compiled
# paths have their own tests, which pass --no-enforce-eager (the flag beats this default).
os.environ.setdefault("RAGSERVE_ENFORCE_EAGER", "1")


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def triton_interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRITON_INTERPRET=1 for one test of the interpreted Triton kernels (tests.helpers.triton_interpret)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
