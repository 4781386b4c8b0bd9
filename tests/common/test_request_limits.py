"""ragserve.http.limits.check_request on parsed bodies: the router and the engine refuse the same fields with the
same 400 (tests/reliability/test_bad_input.py sends them to the real servers)."""

from __future__ import annotations

import pytest

from ragserve.http.errors import ApiError
from ragserve.http.limits import MAX_LOGPROBS, MAX_N, MAX_TOKENS, check_request

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


def refused(body: dict, chat: bool, max_model_len: int | None = None) -> str:
    with pytest.raises(ApiError) as caught:
        check_request(body, chat, max_model_len)
    assert caught.value.status == 400
    return caught.value.param


def test_a_body_within_every_limit_passes():
    extra = {"max_tokens": 16, "n": 2, "seed": -1, "top_k": -1, "temperature": 0.5, "stream": True, "stop": ["x"]}
    extra |= {"logit_bias": {"42": -100}, "stop_token_ids": [1, 2], "priority": 3, "user": "u", "unknown": [1]}
    check_request(CHAT | extra | {"logprobs": True, "top_logprobs": MAX_LOGPROBS}, True)
    check_request(COMPLETION | extra | {"logprobs": MAX_LOGPROBS, "echo": False}, False)
    check_request(COMPLETION | {"max_tokens": None, "n": None}, False)  # null: the default


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0), ("max_tokens", MAX_TOKENS + 1), ("max_completion_tokens", True), ("min_tokens", -1),
        ("n", MAX_N + 1), ("best_of", 0), ("seed", 2**63), ("top_k", -2), ("priority", 1.5),
        ("temperature", float("nan")), ("top_p", "1"), ("stream", 1), ("ignore_eos", "yes"),
        ("include_stop_str_in_output", 0), ("model", ""), ("cache_salt", "x" * 257), ("stop", ["x"] * 17),
        ("stop_token_ids", [-1]), ("resume_token_ids", ["a"]), ("logit_bias", {"a": 1}), ("logit_bias", {"1": 101}),
    ],
)  # fmt: skip
def test_each_field_out_of_its_limit_is_a_400_naming_it(field, value):
    assert refused(CHAT | {field: value}, True) == field
    assert refused(COMPLETION | {field: value}, False) == field


def test_logprobs_is_a_flag_in_chat_and_a_count_in_completions():
    assert refused(CHAT | {"logprobs": 5}, True) == "logprobs"
    assert refused(COMPLETION | {"logprobs": True}, False) == "logprobs"
    assert refused(COMPLETION | {"logprobs": MAX_LOGPROBS + 1}, False) == "logprobs"
    assert refused(CHAT | {"top_logprobs": MAX_LOGPROBS + 1}, True) == "top_logprobs"
    check_request(COMPLETION | {"top_logprobs": "ignored"}, False)  # not a completions field


def test_token_counts_are_capped_by_the_context_length_when_known():
    check_request(CHAT | {"max_tokens": 4096, "resume_token_ids": [0] * 4096}, True, 4096)
    assert refused(CHAT | {"max_tokens": 4097}, True, 4096) == "max_tokens"
    assert refused(CHAT | {"min_tokens": 4097}, True, 4096) == "min_tokens"
    assert refused(CHAT | {"resume_token_ids": [0] * 4097}, True, 4096) == "resume_token_ids"
    assert refused(CHAT | {"stop_token_ids": [0] * 257}, True, 1 << 20) == "stop_token_ids"  # its own cap


def test_the_first_bad_field_in_the_body_is_the_one_named():
    assert refused(CHAT | {"n": 0, "max_tokens": 0}, True) == "n"
    assert refused(CHAT | {"max_tokens": 0, "n": 0}, True) == "max_tokens"
