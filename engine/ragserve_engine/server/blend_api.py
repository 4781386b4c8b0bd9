"""The OpenAI side of blending: a chat whose content parts mark chunks becomes token ids and a BlendSpec.

Torch-free (the server imports it before the model loads). The request shape is in docs/blend.md.
"""

from __future__ import annotations

from ragserve.chunks import ChunkPartError, encode_chunked_chat, has_chunks
from ragserve.http.limits import invalid
from ragserve.tokenizer import PromptTokenizer
from ragserve_engine.engine_client import BlendSpec

FRACTION_FIELD = "blend_recompute_fraction"


def chunked_chat(tokenizer: PromptTokenizer, messages: list[dict], req) -> tuple[list[int], dict] | None:
    """A chat with chunk parts: its token ids and generate() options ({"blend": spec}); None for a plain chat.

    `req` is the ChatCompletionRequest: its extension field `blend_recompute_fraction` (0..1, default: the
    engine's) is read here. A bad field or chunk part is an ApiError 400 whose `param` names it (the fraction,
    or the part's dotted path); a template error a ValueError."""
    fraction = (req.model_extra or {}).get(FRACTION_FIELD)
    if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, int | float)):
        raise invalid(FRACTION_FIELD, "must be a number in [0, 1]")
    if fraction is not None and not 0 <= fraction <= 1:
        raise invalid(FRACTION_FIELD, f"must be in [0, 1], got {fraction}")
    try:
        if not has_chunks(messages):
            return None
    except ChunkPartError as exc:
        raise invalid(exc.param, exc.detail) from None
    prompt = encode_chunked_chat(tokenizer, messages)
    if not prompt.spans:  # only empty chunks
        return prompt.token_ids, {}
    return prompt.token_ids, {"blend": BlendSpec(prompt.spans, fraction)}


def usage_details(outputs) -> dict:
    """usage.prompt_tokens_details additions for blended requests (none for others): their prompt tokens by
    source, each token in one (docs/blend.md): reused (KV that existed before the request), computed_chunk
    (chunks first computed for it), recomputed (by the blended forward)."""
    usages = [o.blend_usage for o in outputs if o.blend_usage is not None]
    if not usages:
        return {}
    return {
        "blend_reused_tokens": sum(u.reused_tokens for u in usages),
        "blend_computed_chunk_tokens": sum(u.computed_chunk_tokens for u in usages),
        "blend_recomputed_tokens": sum(u.recomputed_tokens for u in usages),
    }
