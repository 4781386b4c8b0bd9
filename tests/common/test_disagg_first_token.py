"""ragserve.disagg.first_token: when the decode engine may start from the prefill leg's token, from the client's body
and the leg's answer (the engines' own behaviour with it: tests/engine/test_disagg_engine.py, tests/router/
test_disagg.py)."""

from __future__ import annotations

import json

import pytest

from ragserve.disagg import first_token, prefill_body


def leg(token=42, finish="length", prompt_tokens=100, choices=1) -> bytes:
    choice = {"index": 0, "message": {"content": "x"}, "finish_reason": finish, "token_ids": [token]}
    return json.dumps({"choices": [choice] * choices, "usage": {"prompt_tokens": prompt_tokens}}).encode()


def test_the_leg_asks_for_its_token_ids():
    body = json.loads(prefill_body({"model": "m", "messages": [], "n": 3, "return_token_ids": False, "seed": 1}))
    assert body == {"model": "m", "messages": [], "seed": 1, "max_tokens": 1, "stream": False, "return_token_ids": True}


def test_a_plain_request_starts_from_the_leg_token():
    assert first_token({"model": "m", "max_tokens": 8}, leg(), 4096) == 42
    assert first_token({"model": "m", "temperature": 0.7, "seed": 3}, leg(), 4096) == 42  # seeded: the same draw
    assert first_token({"model": "m", "max_completion_tokens": 2, "logprobs": False}, leg(), 4096) == 42


@pytest.mark.parametrize(
    "body",
    [
        {"n": 2},
        {"best_of": 3},
        {"use_beam_search": True},
        {"logprobs": True},
        {"logprobs": 0},  # completions: token logprobs asked
        {"top_logprobs": 2},
        {"prompt_logprobs": 1},
        {"min_tokens": 4},  # the leg did not mask EOS
        {"resume_token_ids": [1]},
        {"first_token_id": 9},
        {"max_tokens": 1},  # the leg's token is the whole answer
    ],
)
def test_requests_that_cannot_start_there(body):
    assert first_token({"model": "m", **body}, leg(), 4096) is None


def test_answers_that_give_no_token_to_start_from():
    assert first_token({}, leg(finish="stop"), 4096) is None  # EOS or a stop string: the decode engine decides
    assert first_token({}, leg(choices=2), 4096) is None
    assert first_token({}, b"not json", 4096) is None
    assert first_token({}, json.dumps({"choices": [{"finish_reason": "length"}]}).encode(), 4096) is None
    assert first_token({}, leg(token="7"), 4096) is None
    assert first_token({}, leg(prompt_tokens=4095), 4096) is None  # no max_tokens and one token of context left
    assert first_token({}, leg(prompt_tokens=4094), 4096) == 42
    assert first_token({}, leg(), 0) is None  # context unknown (an engine that did not say)
