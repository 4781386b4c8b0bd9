"""bench/disagg.py's measure of a user's inter-token gaps: one gap per token-carrying chunk, so a token that brings no
text (here SmolLM2's <|im_end|>, decoded on by an ignore_eos user) is still a step of its own, not added to the next
gap (counted by text, the unloaded p99 swung with what the model wrote: docs/disaggregation.md)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import httpx
import pytest

from tests.helpers.engine_server import MODEL_NAME, running_engine
from tests.helpers.stack import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import disagg  # noqa: E402  (bench/ is not a package)

TOKENS = 24


def test_every_token_is_one_gap(tmp_path):
    messages = [{"role": "user", "content": "Is the sky blue? Answer with one word."}]
    body = disagg.decode_body(TOKENS) | {"model": MODEL_NAME, "messages": messages, "temperature": 0}

    async def user(url: str) -> disagg.Stream:
        async with httpx.AsyncClient(timeout=120) as client:
            return await disagg.stream(client, url, body)

    with running_engine(tmp_path, "--model", "smollm2-135m", "--device", "cpu", "--enforce-eager") as engine:
        s = asyncio.run(user(engine.url))
    assert s.tokens == TOKENS and s.multi == 0
    assert s.textless >= 1  # the answer's end: the case the measure is for
    assert len(s.times) == 1 + TOKENS  # the send time, then one arrival per token
    assert len(disagg.itls([s])) == TOKENS - 1


def test_append_refuses_mixing_eager_and_compiled(tmp_path):
    """--eager runs are their own files, and a file's repeats are all eager or all compiled: --append refuses a
    file whose workload differs (a run before the flag existed, without `eager`, included)."""
    workload = {"decoders": 2, "window": 48.0, "decode_tokens": 2000, "rag_clients": 2, "rag_tokens": 16, "aux_core": 0}
    args = argparse.Namespace(**workload, eager=False, transfer_core=None, quick=False, out=str(tmp_path), append=True)
    assert disagg.result_path(args).name == "disagg.json"
    assert disagg.result_path(argparse.Namespace(**vars(args) | {"eager": True})).name == "disagg-eager.json"
    assert disagg.result_path(argparse.Namespace(**vars(args) | {"transfer_core": 0})).name == "disagg-transfer0.json"
    for prior in (workload | {"eager": True}, workload):
        disagg.result_path(args).write_text(json.dumps({"workload": prior}))
        with pytest.raises(SystemExit, match="another workload"):
            disagg.previous(args)
    disagg.result_path(args).write_text(json.dumps({"workload": workload | {"eager": False}}))
    assert disagg.previous(args)["workload"]["eager"] is False  # a file from before --transfer-core: none
    moved = argparse.Namespace(**vars(args) | {"transfer_core": 0})
    disagg.result_path(moved).write_text(json.dumps({"workload": workload | {"eager": False}}))
    with pytest.raises(SystemExit, match="another workload"):
        disagg.previous(moved)
