"""A small OpenAI-compatible server for router tests, run as a real process on loopback.

Stands in for "any OpenAI-compatible server" (a static engine) and, with --router, for an
engine speaking the registry protocol: it tokenizes and hashes prompts with the shared
code, keeps the hashes as its "prefix cache", reports `cached_tokens` in usage, heartbeats
its load and streams KV events. It generates no real text (the router never reads it).
Knobs for failure tests: --fail-status, /control/* endpoints (hold streams, count aborts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ragserve.keys import KEY_SCHEME, block_hashes, probe_hashes, root_hash
from ragserve.tokenizer import PromptTokenizer
from ragserve.v1 import registry_pb2, registry_pb2_grpc


class Engine:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tok = PromptTokenizer.from_dir(args.model_dir)
        self.root = root_hash(args.model_id)
        self.cache: dict[bytes, None] = {}  # insertion-ordered: LRU by re-insertion
        self.events: list[registry_pb2.KVEvent] = []
        self.running = 0
        self.served = 0
        self.aborted = 0
        self.release = asyncio.Event()
        self.release.set()
        self.new_events = asyncio.Event()
        self.compute = asyncio.Lock()

    def prompt_tokens(self, body: dict, chat: bool) -> list[int]:
        if chat:
            return self.tok.encode_chat(body["messages"])
        prompt = body["prompt"]
        return prompt if isinstance(prompt, list) else self.tok.encode(prompt)

    def prefill(self, tokens: list[int], salt: str | None) -> int:
        """Cached tokens of this prompt; then its blocks are cached (and announced)."""
        bs = self.args.block_size
        hashes = block_hashes(tokens, bs, self.root, cache_salt=salt)
        hits = 0
        for h in hashes:
            if h not in self.cache:
                break
            hits += 1
        new = [h for h in hashes if h not in self.cache]
        for h in hashes:
            self.cache.pop(h, None)
            self.cache[h] = None
        evicted = []
        while len(self.cache) > self.args.num_blocks:
            evicted.append(next(iter(self.cache)))
            del self.cache[evicted[-1]]
        if new:
            self._event(stored=registry_pb2.BlocksStored(block_hashes=new))
        if evicted:
            self._event(removed=registry_pb2.BlocksRemoved(block_hashes=evicted))
        return min(hits * bs, (len(tokens) - 1) // bs * bs)

    def _event(self, **kind) -> None:
        self.events.append(registry_pb2.KVEvent(seq=len(self.events) + 1, **kind))
        self.new_events.set()

    def snapshot(self) -> None:
        """The router lost our events: renumber from 1 with a full snapshot."""
        self.events = []
        self._event(cleared=registry_pb2.AllBlocksCleared())
        if self.cache:
            self._event(stored=registry_pb2.BlocksStored(block_hashes=list(self.cache)))


def build_app(engine: Engine) -> FastAPI:
    app = FastAPI()
    args = engine.args

    async def complete(request: Request, chat: bool):
        if args.fail_status:
            scope = {"x-ragserve-error-scope": args.fail_scope} if args.fail_scope else None
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=args.fail_status, headers=scope)
        body = await request.json()
        if body.get("model") != args.served_model_name:
            return JSONResponse({"error": {"message": "wrong model", "code": "model_not_found"}}, status_code=404)
        try:
            tokens = engine.prompt_tokens(body, chat)
        except (KeyError, TypeError, ValueError) as exc:
            error = {"message": f"bad request: {exc!r}", "type": "invalid_request_error", "param": None, "code": None}
            return JSONResponse({"error": error}, status_code=400)
        cached = engine.prefill(tokens, body.get("cache_salt"))
        async with engine.compute:  # one prefill at a time, like an accelerator busy with a batch
            await asyncio.sleep(args.prefill_delay * (len(tokens) - cached) / args.block_size)
        usage = {
            "prompt_tokens": len(tokens),
            "completion_tokens": 2,
            "total_tokens": len(tokens) + 2,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        obj = "chat.completion" if chat else "text_completion"
        created = int(time.time())
        if not body.get("stream"):
            engine.served += 1
            choice = {"index": 0, "finish_reason": "length"}
            choice.update({"message": {"role": "assistant", "content": "ok ok"}} if chat else {"text": "ok ok"})
            return {
                "id": "x",
                "object": obj,
                "created": created,
                "model": args.served_model_name,
                "choices": [choice],
                "usage": usage,
            }
        return StreamingResponse(stream(body, chat, usage, created), media_type="text/event-stream")

    async def stream(body: dict, chat: bool, usage: dict, created: int):
        engine.running += 1
        done = False
        try:
            for i, piece in enumerate(["ok", " ok"]):
                delta = {"delta": {"content": piece}} if chat else {"text": piece}
                chunk = {
                    "id": "x",
                    "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": created,
                    "model": args.served_model_name,
                    "choices": [{"index": 0, **delta, "finish_reason": None if i == 0 else "length"}],
                }
                yield f"data: {json.dumps(chunk)}\n\n"
                if i == 0:
                    await engine.release.wait()
            if (body.get("stream_options") or {}).get("include_usage"):
                tail = {
                    "id": "x",
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": args.served_model_name,
                    "choices": [],
                    "usage": usage,
                }
                yield f"data: {json.dumps(tail)}\n\n"
            yield "data: [DONE]\n\n"
            done = True
            engine.served += 1
        finally:
            engine.running -= 1
            if not done:
                engine.aborted += 1

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await complete(request, True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, False)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": args.served_model_name, "object": "model", "owned_by": "test"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        name = args.served_model_name
        return PlainTextResponse(
            f'vllm:num_requests_running{{model_name="{name}"}} {engine.running}\n'
            f'vllm:num_requests_waiting{{model_name="{name}"}} 0\n'
            f'vllm:kv_cache_usage_perc{{model_name="{name}"}} {len(engine.cache) / args.num_blocks}\n'
        )

    @app.post("/control/hold")
    async def hold():
        engine.release.clear()
        return {}

    @app.post("/control/release")
    async def release():
        engine.release.set()
        return {}

    @app.get("/control/stats")
    async def stats():
        return {
            "served": engine.served,
            "aborted": engine.aborted,
            "running": engine.running,
            "cached_blocks": len(engine.cache),
        }

    return app


def register_request(engine: Engine) -> registry_pb2.RegisterRequest:
    args = engine.args
    tok = engine.tok
    return registry_pb2.RegisterRequest(
        identity=registry_pb2.EngineIdentity(
            engine_id=args.engine_id,
            url=f"http://127.0.0.1:{args.port}",
            served_model_name=args.served_model_name,
            model_id=args.model_id,
            key_scheme=args.key_scheme,
            block_size=args.block_size,
            tokenizer_fingerprint=tok.fingerprint(),
            version="test",
        ),
        tokenizer_json=tok.tokenizer_json.encode(),
        chat_template=tok.chat_template or "",
        special_tokens_json=json.dumps(tok.special_tokens),
        num_blocks=args.num_blocks,
        probe_block_hashes=probe_hashes(tok, args.block_size, args.model_id),
    )


async def cluster_duties(engine: Engine) -> None:
    """Register, heartbeat and stream KV events; re-register whenever the router forgets us."""
    async with grpc.aio.insecure_channel(engine.args.router) as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        while True:
            try:
                resp = await stub.Register(register_request(engine))
                if resp.resume_from_seq == 0 or resp.resume_from_seq > len(engine.events):
                    engine.snapshot()
                sender = asyncio.create_task(send_events(engine, stub, resp.resume_from_seq))
                try:
                    await heartbeats(engine, stub, resp.heartbeat_interval_ms / 1000, sender)
                finally:
                    sender.cancel()
            except grpc.aio.AioRpcError as exc:
                print(f"fake engine: registry error {exc.code()}: {exc.details()}", flush=True)
                await asyncio.sleep(0.5)


async def heartbeats(engine: Engine, stub, interval: float, sender: asyncio.Task) -> None:
    while not sender.done():
        load = registry_pb2.Load(num_running=engine.running, kv_usage=len(engine.cache) / engine.args.num_blocks)
        resp = await stub.Heartbeat(registry_pb2.HeartbeatRequest(engine_id=engine.args.engine_id, load=load))
        if not resp.known:
            return
        await asyncio.sleep(interval)


async def send_events(engine: Engine, stub, acked: int) -> None:
    async def batches():
        nonlocal sent
        while True:
            if sent < len(engine.events):
                batch = engine.events[sent:]
                sent = len(engine.events)
                yield registry_pb2.KVEventBatch(engine_id=engine.args.engine_id, events=batch)
            engine.new_events.clear()
            await engine.new_events.wait()

    sent = acked
    async for _ack in stub.StreamKVEvents(batches()):
        pass


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--engine-id", required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--served-model-name", default="tiny")
    p.add_argument("--model-id", default="tiny@test")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--key-scheme", default=KEY_SCHEME)
    p.add_argument("--router", default=None, help="registry HOST:PORT")
    p.add_argument("--prefill-delay", type=float, default=0.0, help="seconds per uncached block")
    p.add_argument("--fail-status", type=int, default=0)
    p.add_argument("--fail-scope", default="", help="x-ragserve-error-scope of the injected failures")
    args = p.parse_args()
    engine = Engine(args)
    server = uvicorn.Server(uvicorn.Config(build_app(engine), host="127.0.0.1", port=args.port, log_level="warning"))
    duties = asyncio.create_task(cluster_duties(engine)) if args.router else None
    await server.serve()
    if duties:
        duties.cancel()


if __name__ == "__main__":
    asyncio.run(main())
