"""POST /v1/chat/completions: the chat template, then chat.completion(.chunk) objects."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import Response

from ragserve_engine.engine_client import RequestOutput
from ragserve_engine.server.blend_api import chunked_chat
from ragserve_engine.server.errors import bad_request
from ragserve_engine.server.logprobs import LogprobFormatter
from ragserve_engine.server.protocol import ChatCompletionRequest
from ragserve_engine.server.serving_base import OpenAIServing, stop_holdback, usage
from ragserve_engine.server.streaming import ChoiceCursor, unsent_text

OFFLOAD_BYTES = 32 * 1024  # tokenize bigger prompts off the event loop


class ChatServing(OpenAIServing):
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"
    prompt_param = "messages"
    id_prefix = "chatcmpl"

    async def create(self, request: Request, req: ChatCompletionRequest) -> Response:
        self.server.check_model(req.model)
        try:
            # chunk parts first: a badly marked part is named (a non-text one too, which rendering refuses)
            blended = chunked_chat(self.tokenizer, [m.model_dump(exclude_unset=True) for m in req.messages], req)
            messages = req.render_messages() if blended is None else []
            params = req.to_sampling_params()
        except ValueError as exc:  # template errors too
            raise bad_request(exc, "messages") from None
        if blended is not None:
            return await self.run(request, req, [blended[0]], params, **blended[1])
        try:
            size = sum(len(m.get("content") or "") for m in messages)
            encode = self.tokenizer.encode_chat
            prompt = await asyncio.to_thread(encode, messages) if size > OFFLOAD_BYTES else encode(messages)
        except ValueError as exc:  # template errors
            raise bad_request(exc, "messages") from None
        return await self.run(request, req, [prompt], params)

    def _logprobs(self, req: ChatCompletionRequest) -> LogprobFormatter | None:
        return LogprobFormatter(self.tokenizer, req.top_logprobs or 0) if req.logprobs else None

    def response(self, req, prompts, finals: dict[int, RequestOutput], header: dict) -> dict:
        fmt, out = self._logprobs(req), finals[0]
        holdback = stop_holdback(req.stop_strings)
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": unsent_text(out.resumed_text, c.text, holdback)},
                "logprobs": fmt.chat(c.token_ids, c.logprobs or []) if fmt else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            | ({"token_ids": c.token_ids} if req.return_token_ids else {})
            for c in out.outputs
        ]
        return {**header, "choices": choices, "usage": usage(finals)}

    async def chunks(self, gen, req: ChatCompletionRequest, prompts, last: dict):
        fmt, ids = self._logprobs(req), req.return_token_ids
        cursors: dict[int, ChoiceCursor] = {}
        done: set[int] = set()
        holdback = stop_holdback(req.stop_strings)
        async for i, out in gen.outputs():
            last[i] = out
            for c in out.outputs:
                if c.index in done:
                    continue
                if c.index not in cursors:
                    cursors[c.index] = ChoiceCursor(holdback, out.resumed_text)
                    if not req.resumed:  # a resumed stream continues one that said this already
                        yield _chunk(c.index, {"role": "assistant", "content": ""}, token_ids=[] if ids else None)
                delta, tokens, entries = cursors[c.index].advance(c)
                if c.finished:
                    done.add(c.index)
                elif not delta and not ((fmt or ids) and tokens):
                    continue
                logprobs = fmt.chat(tokens, entries) if fmt else None
                delta = {"content": delta} if delta else {}
                yield _chunk(c.index, delta, logprobs, c.finish_reason, tokens if ids else None)


def _chunk(
    index: int,
    delta: dict,
    logprobs: dict | None = None,
    finish_reason: str | None = None,
    token_ids: list[int] | None = None,
) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"choices": [choice | ({"token_ids": token_ids} if token_ids is not None else {})]}
