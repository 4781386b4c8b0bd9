"""The OpenAI side of blending: a chat whose content parts mark chunks becomes token ids and a BlendSpec.

Torch-free (the server imports it before the model loads). The request shape is in docs/blend.md.
"""

from __future__ import annotations

from ragserve.chunks import encode_chunked_chat, has_chunks
from ragserve.tokenizer import PromptTokenizer
from ragserve_engine.engine_client import BlendSpec

FRACTION_FIELD = "blend_recompute_fraction"


def chunked_chat(tokenizer: PromptTokenizer, messages: list[dict], req) -> tuple[list[int], dict] | None:
    """A chat with chunk parts: its token ids and generate() options ({"blend": spec}); None for a plain chat.

    `req` is the ChatCompletionRequest: its extension field `blend_recompute_fraction` (0..1, default: the
    engine's) is read here. Raises ValueError naming the field."""
    fraction = (req.model_extra or {}).get(FRACTION_FIELD)
    if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, int | float)):
        raise ValueError(f"{FRACTION_FIELD} must be a number in [0, 1]")
    if fraction is not None and not 0 <= fraction <= 1:
        raise ValueError(f"{FRACTION_FIELD} must be in [0, 1], got {fraction}")
    if not has_chunks(messages):
        return None
    prompt = encode_chunked_chat(tokenizer, messages)
    if not prompt.spans:  # only empty chunks
        return prompt.token_ids, {}
    return prompt.token_ids, {"blend": BlendSpec(prompt.spans, fraction)}


def usage_details(outputs) -> dict:
    """usage.prompt_tokens_details additions: reused chunk tokens, only for blended requests."""
    reused = sum(o.num_blend_reused_tokens for o in outputs)
    return {"blend_reused_tokens": reused} if reused else {}
