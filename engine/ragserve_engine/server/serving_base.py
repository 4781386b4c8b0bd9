"""What chat and completions share: admission checks, request ids, running a Generation, usage."""

from __future__ import annotations

import logging
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ragserve import tracing
from ragserve_engine.engine_client import EngineError, RequestError, RequestOutput
from ragserve_engine.server.blend_api import usage_details
from ragserve_engine.server.errors import bad_request, failure, failure_event
from ragserve_engine.server.generation import Generation
from ragserve_engine.server.protocol import SamplingRequest
from ragserve_engine.server.streaming import EventStreamResponse, sse
from ragserve_engine.server.transport import ClientDisconnected, until_disconnect

log = logging.getLogger("ragserve_engine.server")
CLIENT_CLOSED = 499


def usage(outputs: dict[int, RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs.values())
    completion = sum(len(c.token_ids) for o in outputs.values() for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs.values())
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached, **usage_details(outputs.values())},
    }


def stop_holdback(stop: list[str]) -> int:
    return max((len(s) for s in stop), default=1) - 1


class OpenAIServing:
    """Subclasses build prompts and shape responses; this runs them."""

    object_name = ""
    chunk_object = ""
    prompt_param = ""
    id_prefix = ""

    def __init__(self, server) -> None:
        self.server = server

    @property
    def tokenizer(self):
        return self.server.llm.tokenizer

    def header(self, request_id: str, created: int) -> dict:
        return {"id": request_id, "object": self.object_name, "created": created, "model": self.server.model_name}

    async def run(self, request: Request, req: SamplingRequest, prompts: list, params, **extra) -> Response:
        """`extra`: further generate() options (a chat's blend spec)."""
        request_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        kw = {"priority": req.priority, "cache_salt": req.cache_salt, "resume_token_ids": req.resume_token_ids,
              "first_token_id": req.first_token_id}  # fmt: skip
        kw |= extra
        gen = Generation(self.server, prompts, params, request_id, **kw)
        gen.trace_parent = tracing.extract(request.headers)
        created = int(time.time())
        try:
            await until_disconnect(request, gen.start())
            if req.stream:
                return EventStreamResponse(self._stream(gen, req, prompts, request_id, created), gen.close)
            finals = await until_disconnect(request, collect(gen))
        except ValueError as exc:
            raise bad_request(exc, self.prompt_param) from None
        except (RequestError, EngineError) as exc:
            raise failure(exc) from None
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED)
        body = self.response(req, prompts, finals, self.header(request_id, created))
        return JSONResponse(body)

    async def _stream(self, gen: Generation, req: SamplingRequest, prompts: list, request_id: str, created: int):
        last: dict[int, RequestOutput] = {}
        header = {**self.header(request_id, created), "object": self.chunk_object}
        try:
            async for chunk in self.chunks(gen, req, prompts, last):
                yield sse({**header, **chunk, **({"usage": None} if req.include_usage else {})})
            if req.include_usage:
                yield sse({**header, "choices": [], "usage": usage(last)})
        except Exception as exc:  # a failure after the headers went out: an error event ends the stream
            log.warning("request %s: stream failed: %s", request_id, exc)
            yield sse(failure_event(exc))
            return
        yield sse("[DONE]")

    async def chunks(self, gen: Generation, req: SamplingRequest, prompts: list, last: dict):
        """Yield {"choices": [...]} dicts; record the latest output per prompt in `last`."""
        raise NotImplementedError
        yield {}

    def response(self, req: SamplingRequest, prompts: list, finals: dict[int, RequestOutput], header: dict) -> dict:
        raise NotImplementedError


async def collect(gen: Generation) -> dict[int, RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    async for i, out in gen.outputs():
        finals[i] = out
    return finals
