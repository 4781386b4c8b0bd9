"""Relay._plain handles a ragserve engine's middle chunks on their bytes: for every stream shape (chat and
completions, resumable or not, the client asking for token ids and usage or not, tool-call and unicode deltas,
logprobs) the client gets exactly the bytes, and the relay the token ids, of the parsed path (_chunk + json.dumps);
the chunks it does not handle (first, last, usage, errors, other JSON layouts) go to the parsed path."""

from __future__ import annotations

import json

import pytest

from ragserve_router.relay import Relay
from ragserve_router.resume import ResumePlan


def sse(obj: dict) -> bytes:  # as the engine writes an event (engine/ragserve_engine/server/streaming.py)
    return f"data: {json.dumps(obj, ensure_ascii=False)}".encode()


def stream(chat: bool, ids: bool, usage: bool) -> list[bytes]:
    """A four-token stream as a ragserve engine sends it for these options."""
    head = {"id": "chatcmpl-1" if chat else "cmpl-1", "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 7, "model": "m"}  # fmt: skip
    pieces = [("Hé", [11]), (' "quoted" , "token_ids": [9]', [12, 13]), ("東京😁", [14]), ("", [])]
    events = []
    for k, (text, tokens) in enumerate(pieces):
        delta = {"content": text} if chat else None
        choice = {"index": 0, **({"delta": delta} if chat else {"text": text})}
        choice |= {"logprobs": {"content": []} if k == 1 else None, "finish_reason": "stop" if k == 3 else None}
        if k == 2 and chat:
            choice["delta"] = {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]}
        if ids:
            choice["token_ids"] = tokens
        events.append(sse({**head, "choices": [choice], **({"usage": None} if usage else {})}))
    if usage:
        events.append(sse({**head, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}))
    events.append(sse({"error": {"message": "x", "scope": "engine"}}))
    return events


def relay(body: dict, chat: bool, reason: str) -> Relay:
    r = Relay.__new__(Relay)
    r.plan = ResumePlan(body, json.dumps(body).encode(), chat, reason)
    r.first, r.migrations, r.tokens, r.prior, r.finished, r.usage, r.outcome = {}, 0, [], 0, False, None, "cut"
    return r


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("client_ids", [True, False])
@pytest.mark.parametrize("client_usage", [True, False])
@pytest.mark.parametrize("resumable", [True, False])
def test_the_byte_path_gives_the_parsed_paths_bytes_and_token_ids(chat, client_ids, client_usage, resumable):
    body = {"stream": True, "return_token_ids": client_ids}
    if client_usage:
        body["stream_options"] = {"include_usage": True}
    plan = ResumePlan(body, b"", chat, "" if resumable else "not_streamed")
    events = stream(chat, ids=resumable or client_ids, usage=plan.hides_usage or client_usage)
    fast, slow = relay(body, chat, plan.reason), relay(body, chat, plan.reason)
    slow._plain = lambda data: None  # the parsed path alone
    handled, plain = [], fast._plain
    fast._plain = lambda data: handled.append(plain(data)) or handled[-1]
    for event in events:
        assert fast._event(event) == slow._event(event), event
        assert (fast.tokens, fast.finished, fast.usage, fast.outcome) == (
            slow.tokens, slow.finished, slow.usage, slow.outcome)  # fmt: skip
    assert sum(out is not None for out in handled) == 2  # the two middle chunks took the byte path
    if resumable:
        assert fast.tokens == [11, 12, 13, 14]


def test_chunks_it_does_not_handle_go_to_the_parsed_path() -> None:
    r = relay({"stream": True}, True, "")
    r.first = {"id": "x"}
    middle = {"id": "x", "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None, "token_ids": [1]}]}
    assert r._plain(json.dumps(middle).encode()) is not None
    compact = json.dumps(middle, separators=(",", ":")).encode()  # another engine's layout
    two = {**middle, "choices": middle["choices"] * 2}
    usage = {**middle, "usage": {"prompt_tokens": 1}}
    no_ids = {"id": "x", "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]}
    for data in (compact, json.dumps(two).encode(), json.dumps(usage).encode(), json.dumps(no_ids).encode()):
        assert r._plain(data) is None, data
    r.migrations = 1  # a resumed segment's chunks are rewritten (id, created)
    assert r._plain(json.dumps(middle).encode()) is None
    r.migrations, r.first = 0, {}
    assert r._plain(json.dumps(middle).encode()) is None  # the first chunk
