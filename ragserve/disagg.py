"""Disaggregated prefill/decode (docs/disaggregation.md): the prefill leg's request, one implementation for the two
that run it: the router (ragserve_router/disagg.py) and a decode engine named a prefiller by the endpoint picker's
`x-prefiller-host-port` header (ragserve_engine/server/prefiller.py)."""

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


def prefill_body(body: dict) -> bytes:
    """The prefill leg's request: the client's prompt and settings, one token, not streamed."""
    leg = {k: v for k, v in body.items() if k not in GENERATION_ONLY}
    return json.dumps({**leg, "max_tokens": 1, "stream": False}).encode()


def prefill_headers(headers: dict[str, str], request_id: str) -> dict[str, str]:
    """The leg's headers: the decode request's (auth, trace), its own request id, a JSON answer."""
    return headers | {"X-Request-Id": f"{request_id}-prefill", "Accept": "application/json"}


def leg_outcome(status: int) -> str:
    """A prefill engine's answer as a leg's outcome."""
    return OK if status == 200 else REFUSED if status < 500 else FAILED
