"""A fault-injection stand-in for an engine, run as a real process on loopback: only for what a real
`ragserve engine` cannot do on demand. Routing, caching and discovery tests use real engines
(tests/router/conftest.py).

Faults: --fail-status (every completion answers that status, --fail-scope sets its error scope; POST /control/fail
{"status": N} changes it, 0 answers again; /control/stats "received" counts completion requests, failed ones too),
POST /control/probes {"script": [503, 200, ...]} (the next /v1/models probes answer those statuses; stats "probes"),
--prefill-delay (slow prefills), /control/hold and /control/release (streams stop after their first
chunk until released; a client that leaves is counted in /control/stats "aborted"). With --router it
registers and heartbeats, so it can be a registered engine that dies or stalls; it has no prefix cache
(cached_tokens is always 0) and sends no KV events. It generates no text: every answer is "ok ok".
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

from ragserve.keys import KEY_SCHEME, probe_hashes
from ragserve.tokenizer import PromptTokenizer
from ragserve.v1 import registry_pb2, registry_pb2_grpc


class Engine:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tok = PromptTokenizer.from_dir(args.model_dir)
        self.running = 0
        self.served = 0
        self.aborted = 0
        self.received = 0  # completion requests, failed ones included
        self.probes = 0  # GET /v1/models: the router's health probes of a static engine
        self.probe_script: list[int] = []
        self.release = asyncio.Event()
        self.release.set()
        self.compute = asyncio.Lock()

    def prompt_tokens(self, body: dict, chat: bool) -> list[int]:
        if chat:
            return self.tok.encode_chat(body["messages"])
        prompt = body["prompt"]
        return prompt if isinstance(prompt, list) else self.tok.encode(prompt)


def build_app(engine: Engine) -> FastAPI:
    app = FastAPI()
    args = engine.args

    async def complete(request: Request, chat: bool):
        engine.received += 1
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
        async with engine.compute:  # one prefill at a time, like an accelerator busy with a batch
            await asyncio.sleep(args.prefill_delay * len(tokens) / args.block_size)
        usage = {
            "prompt_tokens": len(tokens),
            "completion_tokens": 2,
            "total_tokens": len(tokens) + 2,
            "prompt_tokens_details": {"cached_tokens": 0},
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
        engine.probes += 1
        if engine.probe_script:  # POST /control/probes: the next probes' statuses
            status = engine.probe_script.pop(0)
            if status != 200:
                return JSONResponse({"error": {"message": "injected probe failure"}}, status_code=status)
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
            f'vllm:kv_cache_usage_perc{{model_name="{name}"}} 0\n'
        )

    @app.post("/control/hold")
    async def hold():
        engine.release.clear()
        return {}

    @app.post("/control/release")
    async def release():
        engine.release.set()
        return {}

    @app.post("/control/fail")
    async def fail(request: Request):
        args.fail_status = (await request.json())["status"]  # 0: answer normally again
        return {}

    @app.post("/control/probes")
    async def probes(request: Request):
        engine.probe_script = list((await request.json())["script"])
        return {}

    @app.get("/control/stats")
    async def stats():
        return {
            "served": engine.served,
            "aborted": engine.aborted,
            "received": engine.received,
            "running": engine.running,
            "probes": engine.probes,
            "probe_script_left": len(engine.probe_script),
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
    """Register and heartbeat; re-register whenever the router forgets us."""
    async with grpc.aio.insecure_channel(engine.args.router) as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        while True:
            try:
                resp = await stub.Register(register_request(engine))
                await heartbeats(engine, stub, resp.heartbeat_interval_ms / 1000)
            except grpc.aio.AioRpcError as exc:
                print(f"fake engine: registry error {exc.code()}: {exc.details()}", flush=True)
                await asyncio.sleep(0.5)


async def heartbeats(engine: Engine, stub, interval: float) -> None:
    while True:
        load = registry_pb2.Load(num_running=engine.running, kv_usage=0.0)
        resp = await stub.Heartbeat(registry_pb2.HeartbeatRequest(engine_id=engine.args.engine_id, load=load))
        if not resp.known:
            return
        await asyncio.sleep(interval)


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
    p.add_argument("--prefill-delay", type=float, default=0.0, help="seconds per prompt block (slow prefill)")
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
