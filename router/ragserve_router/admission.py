"""Registration checks: refuse an engine whose block hashes would never match the router's.

The router recomputes the tokenizer fingerprint and the probe block hashes from what the
engine shipped; any difference means a silent 0 % hit rate, so it is refused loudly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ragserve.keys import KEY_SCHEME, probe_hashes
from ragserve.tokenizer import PromptTokenizer
from ragserve.v1 import registry_pb2
from ragserve_router.engines import GRPC, EngineRecord, TokenizerBlob


class Refused(Exception):
    def __init__(self, reason: str, message: str, invalid: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.invalid = invalid  # malformed request (INVALID_ARGUMENT) rather than an incompatible engine


@dataclass
class Admitted:
    record: EngineRecord
    blob: TokenizerBlob
    tokenizer: PromptTokenizer


def _record(req: registry_pb2.RegisterRequest) -> EngineRecord:
    ident = req.identity
    for name in ("engine_id", "url", "served_model_name", "model_id"):
        if not getattr(ident, name):
            raise Refused("invalid", f"identity.{name} is required", invalid=True)
    if not ident.url.startswith(("http://", "https://")):
        raise Refused("invalid", f"identity.url must be an http(s) URL, got {ident.url!r}", invalid=True)
    return EngineRecord(
        engine_id=ident.engine_id,
        url=ident.url.rstrip("/"),
        models=[ident.served_model_name],
        source=GRPC,
        model_id=ident.model_id,
        block_size=ident.block_size,
        tokenizer_fingerprint=ident.tokenizer_fingerprint,
        layout_fingerprint=ident.layout_fingerprint,
        version=ident.version,
        labels=dict(ident.labels),
        cachestore=ident.cachestore,
        role=ident.role or "both",
        num_blocks=req.num_blocks,
        max_model_len=req.max_model_len,
    )


def _tokenizer(
    req: registry_pb2.RegisterRequest, cached: dict[str, PromptTokenizer]
) -> tuple[TokenizerBlob, PromptTokenizer]:
    try:
        specials = json.loads(req.special_tokens_json) if req.special_tokens_json else {}
        if not isinstance(specials, dict):
            raise ValueError("special_tokens_json must be a JSON object")
        blob = TokenizerBlob(req.tokenizer_json.decode(), req.chat_template or None, specials)
        tokenizer = PromptTokenizer(blob.tokenizer_json, blob.chat_template, blob.special_tokens)
        known = cached.get(tokenizer.fingerprint())
        if known is not None:
            return blob, known
        tokenizer.tokenizer  # noqa: B018 - parse now so a broken tokenizer.json is refused here
    except Exception as exc:  # tokenizers raises plain Exception subclasses on bad JSON
        raise Refused("tokenizer", f"cannot load the shipped tokenizer: {exc}") from None
    return blob, tokenizer


def admit(req: registry_pb2.RegisterRequest, live: list[EngineRecord], cached: dict[str, PromptTokenizer]) -> Admitted:
    """Validate a registration against the key scheme and the engines already serving the model.

    Blocking (parses tokenizer.json on first sight): run it in a thread.
    """
    record = _record(req)
    ident = req.identity
    if ident.key_scheme != KEY_SCHEME:
        raise Refused(
            "key_scheme",
            f"engine {ident.engine_id} uses key scheme {ident.key_scheme!r}, this router {KEY_SCHEME!r}: "
            "upgrade one of them so both hash blocks the same way",
        )
    if ident.block_size == 0:
        raise Refused("block_size", f"engine {ident.engine_id} reports block_size 0")
    blob, tokenizer = _tokenizer(req, cached)
    fingerprint = tokenizer.fingerprint()
    if fingerprint != ident.tokenizer_fingerprint:
        raise Refused(
            "tokenizer_fingerprint",
            f"engine {ident.engine_id}: tokenizer fingerprint {ident.tokenizer_fingerprint!r} does not match "
            f"{fingerprint!r} computed from the shipped tokenizer.json, chat template and special tokens",
        )
    _check_probe(req, tokenizer)
    for other in live:
        if other.engine_id == record.engine_id or record.models[0] not in other.models:
            continue
        mine = (record.model_id, record.block_size, record.tokenizer_fingerprint)
        theirs = (other.model_id, other.block_size, other.tokenizer_fingerprint)
        if mine != theirs:
            raise Refused(
                "model_conflict",
                f"engine {ident.engine_id} serves {record.models[0]!r} as (model_id, block_size, tokenizer) "
                f"{mine}, but live engine {other.engine_id} serves it as {theirs}: they would never share "
                "cache hits; use a different --served-model-name",
            )
    record.tokenizer_fingerprint = fingerprint
    return Admitted(record, blob, tokenizer)


def _check_probe(req: registry_pb2.RegisterRequest, tokenizer: PromptTokenizer) -> None:
    ident = req.identity
    try:
        mine = probe_hashes(tokenizer, ident.block_size, ident.model_id)
    except ValueError as exc:  # no chat template: nothing to compare if the engine sent nothing either
        if req.probe_block_hashes:
            raise Refused("probe_hashes", f"engine {ident.engine_id}: router cannot render the probe: {exc}") from None
        return
    if list(req.probe_block_hashes) != mine:
        first = next(
            (i for i, (a, b) in enumerate(zip(mine, req.probe_block_hashes, strict=False)) if a != b),
            min(len(mine), len(req.probe_block_hashes)),
        )
        raise Refused(
            "probe_hashes",
            f"engine {ident.engine_id}: probe block hashes differ from the router's from block {first} "
            f"(engine sent {len(req.probe_block_hashes)}, router computed {len(mine)}): prompts are rendered, "
            "tokenized or hashed differently, so routing on them would never hit",
        )
