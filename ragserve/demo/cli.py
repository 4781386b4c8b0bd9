"""`ragserve demo`: retrieve context for questions from the shipped corpus, ask them through the router."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

from ragserve.flags import add_flag, positive_int
from ragserve.model_source import DEFAULT_EMBED_MODEL

DEFAULT_URL = "http://127.0.0.1:8080"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--url", default=DEFAULT_URL, help="router (or engine) base URL")
    add_flag(parser, "--model", default=None, help="model to ask (default: the first one /v1/models lists)")
    add_flag(
        parser, "--embedding-model", default=DEFAULT_EMBED_MODEL,
        help="model that embeds passages and questions through --url's /v1/embeddings ('local': in this process)",
    )  # fmt: skip
    add_flag(parser, "--question", action="append", help="ask this instead of the built-in questions (repeatable)")
    add_flag(parser, "--top-k", type=positive_int, default=4, help="passages retrieved per question")
    add_flag(
        parser, "--context", default="parent", choices=("parent", "passages", "chunks"), help="what the model gets"
    )
    add_flag(parser, "--corpus", default=None, help="directory of *.md documents (default: the shipped corpus)")
    add_flag(parser, "--max-tokens", type=positive_int, default=64, help="answer length limit")
    add_flag(parser, "--temperature", type=float, default=0.0, help="sampling temperature")
    add_flag(parser, "--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    add_flag(parser, "--timeout", type=float, default=300.0, help="seconds per request")
    add_flag(parser, "--json", default=None, help="also write the results as JSON to this file")
    add_flag(
        parser, "--json-answer", action="store_true", help="ask for a JSON answer citing passage ids (response_format)"
    )


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return asyncio.run(_main(args))


async def _main(args: argparse.Namespace) -> int:
    import httpx
    from rich.console import Console

    from ragserve.demo.session import DemoSession

    console = Console(highlight=False)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout, connect=10.0), headers=headers) as client:
        model = args.model or await _first_model(client, args.url.rstrip("/"), args.embedding_model)
        session = DemoSession(console, client, args.url.rstrip("/"), model, args)
        answered = await session.run()
    if args.json:
        Path(args.json).write_text(json.dumps([a.to_dict() for a in answered], indent=2))
    return 0 if answered and all(a.result.ok for a in answered) else 1


async def _first_model(client, url: str, embedding_model: str) -> str:
    import httpx

    try:
        resp = await client.get(f"{url}/v1/models")
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach {url}: {exc}; start a stack with `ragserve up` or pass --url") from None
    if resp.status_code != 200:
        raise ValueError(f"{url}/v1/models answered HTTP {resp.status_code}: {resp.text[:200]}")
    models = [m["id"] for m in resp.json().get("data", []) if m["id"] != embedding_model]
    if not models:
        raise ValueError(f"{url} serves no model yet (no engine registered?)")
    return models[0]
