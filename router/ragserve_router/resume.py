"""Whether a stream can be resumed on another engine, and the request bodies that do it.

A resumable stream is sent upstream with `return_token_ids` (the engine then streams each chunk's
token ids); when its engine dies, the same request goes to another engine with `resume_token_ids`
(the tokens already streamed) and what is left of `max_tokens` (the engine itself counts them toward
`min_tokens`, penalties and stop strings). Only ragserve engines (registered over gRPC) understand
`resume_token_ids`, and only a reproducible generation (greedy, or seeded) of one choice can continue
without a seam. A stream whose client did not ask for usage asks for it all the same (stream_usage.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ragserve.disagg import FIRST_TOKEN_FIELD
from ragserve_router.engines import EngineRecord
from ragserve_router.stream_usage import hides_usage, with_usage

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI (and engine) default when a completion names none


def unresumable(body: dict, chat: bool, stream: bool, limit: int, engine: EngineRecord) -> str:
    """Why this request cannot be migrated mid-stream ("" when it can)."""
    prompt = body.get("prompt")
    checks = (
        (limit <= 0, "disabled"),
        (not stream, "not_streamed"),
        (not engine.has_events, "foreign_engine"),
        (body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1), "n"),
        (bool(body.get("use_beam_search")), "beam_search"),
        (not chat and isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int), "batch"),
        (not chat and body.get("logprobs") is not None, "logprobs"),
        (body.get("temperature") != 0 and body.get("seed") is None, "sampling_without_seed"),
        ("resume_token_ids" in body, "client_resume"),
        (
            chat and bool(body.get("tools")) and body.get("tool_choice") != "none",
            "tools",
        ),  # a resumed stream would restart the parser mid-call
    )
    return next((reason for failed, reason in checks if failed), "")


@dataclass
class ResumePlan:
    body: dict
    raw: bytes
    chat: bool
    reason: str  # "" when the stream can be resumed
    first_token_id: int | None = None  # the prefill leg's token the answer starts with (disagg.py)

    @property
    def active(self) -> bool:
        return not self.reason

    @property
    def client_wants_ids(self) -> bool:
        return self.body.get("return_token_ids") is True

    @property
    def hides_usage(self) -> bool:
        return hides_usage(self.body)

    def _asking(self) -> dict:
        """The client's body, asking the engine for a stream's usage when the client did not."""
        return with_usage(self.body) if self.hides_usage else self.body

    def upstream_body(self) -> bytes:
        """The first engine's request: the client's, asking for token ids when a resume may need them, and starting
        from the prefill leg's first token when there is one."""
        extra: dict = {"return_token_ids": True} if self.active and not self.client_wants_ids else {}
        if self.first_token_id is not None:
            extra[FIRST_TOKEN_FIELD] = self.first_token_id
        if not extra and not self.hides_usage:
            return self.raw
        return json.dumps({**self._asking(), **extra}).encode()

    def resumed_body(self, token_ids: list[int]) -> bytes | None:
        """The request that continues after token_ids; None when they used up the whole budget."""
        body = {**self._asking(), "return_token_ids": True, "resume_token_ids": token_ids}
        key = "max_completion_tokens" if self.chat and body.get("max_completion_tokens") is not None else "max_tokens"
        budget = body.get(key, None if self.chat else COMPLETIONS_DEFAULT_MAX_TOKENS)
        if isinstance(budget, int):
            if budget - len(token_ids) <= 0:
                return None
            body[key] = budget - len(token_ids)
        if not self.chat:
            body["echo"] = False  # the prompt was echoed by the first engine
        return json.dumps(body).encode()
