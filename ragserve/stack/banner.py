"""What `ragserve up` prints once everything is ready: where the gateway is and how to call it."""

from __future__ import annotations

import json


def banner(stack, model_name: str) -> str:
    url = stack.url
    cfg = stack.cfg
    body = {"model": model_name, "messages": [{"role": "user", "content": "What is a KV cache?"}], "max_tokens": 64}
    sdk = (
        "from openai import OpenAI; "
        f"c = OpenAI(base_url='{url}/v1', api_key='none'); "
        f"print(c.chat.completions.create(model='{model_name}', max_tokens=64, "
        "messages=[{'role': 'user', 'content': 'What is a KV cache?'}]).choices[0].message.content)"
    )
    parts = [f"{cfg.engines} engine(s) serving {model_name}", f"router policy {cfg.policy}"]
    parts.append(f"cachestore {stack.child('cachestore').spec.url}" if cfg.cachestore else "no cachestore")
    parts.append(f"redis {stack.redis_url}" if stack.redis_url else "no redis")
    lines = [
        "",
        "ragserve is up: " + ", ".join(parts),
        f"  gateway (OpenAI API): {url}/v1",
        f"  metrics:              {url}/metrics",
        *([f"  prometheus:           {stack.prometheus_url}"] if stack.prometheus_url else []),
        *(
            f"  {c.name}:{' ' * (20 - len(c.name))}{c.spec.url}"
            for c in stack.children
            if c.name.startswith(("engine-", "embed-"))
        ),  # fmt: skip
        *(
            [f"  embeddings:           model {stack.embedding_model_name}: {url}/v1/embeddings, /v1/rerank, /v1/score"]
            if stack.embedding_model_name
            else []
        ),  # fmt: skip
        "",
        "try:",
        f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{json.dumps(body)}'",
        f'  python -c "{sdk}"',
        f"  ragserve demo --url {url}",
        "",
        "Ctrl-C stops everything.",
    ]
    return "\n".join(lines)
