"""Posting a chat body to an engine and checking a 400 names the field (structured-output and tool tests)."""

from __future__ import annotations

import httpx


def post_chat(engine, body: dict) -> httpx.Response:
    return httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=120)


def assert_400(resp: httpx.Response, param: str) -> None:
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.text
