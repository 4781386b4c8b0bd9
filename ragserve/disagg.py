"""Disaggregated prefill/decode (docs/disaggregation.md): the prefill leg's request and what its answer gives the
decode engine, one implementation for the two that run it: the router (ragserve_router/disagg.py) and a decode
engine named a prefiller by the endpoint picker's `x-prefiller-host-port` header (ragserve_engine/server/prefiller.py).
"""

from __future__ import annotations

import json

PREFILL, DECODE, BOTH = "prefill", "decode", "both"
PREFILLER_HEADER = "x-prefiller-host-port"  # llm-d's name: the prefill engine a decode engine runs the leg on
# generation-only fields: the prefill leg computes the prompt and one token, whatever the client asked for
GENERATION_ONLY = (
    "stream", "stream_options", "n", "best_of", "use_beam_search", "logprobs", "top_logprobs", "prompt_logprobs",
    "echo", "min_tokens", "max_completion_tokens", "return_token_ids", "resume_token_ids",
)  # fmt: skip
# how a leg ended: its KV is in the store; the prefill engine refused the request (4xx: the request's own fault; it
# goes to the decode engine unchanged, which answers it, with its own error if it finds the same fault); it failed
# (died, timed out, 5xx). Every outcome but ok leaves the prompt to the decode engine to compute.
OK, REFUSED, FAILED = "ok", "refused", "failed"
LEG_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)  # a leg's seconds, router's and engine's alike


FIRST_TOKEN_FIELD = "first_token_id"  # the decode request's: the answer starts with the prefill engine's token


def prefill_body(body: dict) -> bytes:
    """The prefill leg's request: the client's prompt and settings, one token (its id in the answer), not
    streamed."""
    leg = {k: v for k, v in body.items() if k not in GENERATION_ONLY}
    return json.dumps({**leg, "max_tokens": 1, "stream": False, "return_token_ids": True}).encode()


def first_token(body: dict, answer: bytes, max_model_len: int) -> int | None:
    """The prefill leg's token when the decode engine may start from it (`first_token_id`: it then computes no
    prompt token), else None (it computes the last prompt token again and samples the first token itself).

    It may when the leg sampled what the decode engine would have: one choice, no logprobs (the first token's are
    not carried over), no min_tokens (the leg did not mask EOS), nothing given to resume; and the leg stopped for
    length (not at EOS or a stop string) with at least one more token to go (max_tokens, or the context left)."""
    if any(body.get(k) not in (None, 1) for k in ("n", "best_of")) or body.get("use_beam_search"):
        return None
    if any(body.get(k) is not None and body[k] is not False for k in ("logprobs", "top_logprobs", "prompt_logprobs")):
        return None  # (completions' logprobs 0 asks for them)
    if body.get("min_tokens") or body.get("resume_token_ids") or FIRST_TOKEN_FIELD in body:
        return None
    try:
        data = json.loads(answer)
        (choice,) = data["choices"]
        (token,) = choice["token_ids"]
        prompt_tokens = data["usage"]["prompt_tokens"]
    except (ValueError, KeyError, TypeError):
        return None
    if choice.get("finish_reason") != "length" or not isinstance(token, int) or not isinstance(prompt_tokens, int):
        return None
    budget = next((body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None), None)
    budget = max_model_len - prompt_tokens if budget is None else budget
    return token if isinstance(budget, int) and budget >= 2 else None


def prefill_headers(headers: dict[str, str], request_id: str) -> dict[str, str]:
    """The leg's headers: the decode request's (auth, trace), its own request id, a JSON answer."""
    return headers | {"X-Request-Id": f"{request_id}-prefill", "Accept": "application/json"}


def leg_outcome(status: int) -> str:
    """A prefill engine's answer as a leg's outcome."""
    return OK if status == 200 else REFUSED if status < 500 else FAILED
