"""POST /v1/chat/completions: the chat template, then chat.completion(.chunk) objects."""

from __future__ import annotations

import dataclasses
import functools

from fastapi import Request
from fastapi.responses import Response

from ragserve.http.errors import ApiError
from ragserve.tokenizer import encode_beside_loop, long_messages
from ragserve_engine.engine_client import RequestOutput
from ragserve_engine.server.blend_api import chunked_chat
from ragserve_engine.server.errors import bad_request
from ragserve_engine.server.logprobs import LogprobFormatter
from ragserve_engine.server.protocol import ChatCompletionRequest
from ragserve_engine.server.serving_base import OpenAIServing, stop_holdback, usage
from ragserve_engine.server.streaming import ChoiceCursor, unsent_text
from ragserve_engine.server.structured import invalid
from ragserve_engine.server.tool_parsers import PARSERS, ToolCall, ToolParser, specials
from ragserve_engine.server.tools import ToolRequest, ToolStream, forced_grammar, render_messages, tool_request


class ChatServing(OpenAIServing):
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"
    prompt_param = "messages"
    id_prefix = "chatcmpl"

    def __init__(self, server) -> None:
        super().__init__(server)
        self._parser_cls = PARSERS[getattr(server.config, "tool_call_parser", "hermes")]

    @functools.cached_property
    def parser(self) -> ToolParser:
        """Built on first use: the tokenizer (whose special tokens it needs) loads after the server starts."""
        return self._parser_cls(specials(self.tokenizer))

    async def create(self, request: Request, req: ChatCompletionRequest) -> Response:
        self.server.check_model(req.model)
        tools = self._tools(req)
        try:
            # chunk parts first: a badly marked part is named (a non-text one too, which rendering refuses)
            blended = chunked_chat(self.tokenizer, [m.model_dump(exclude_unset=True) for m in req.messages], req)
            messages = req.render_messages() if blended is None else []
            params = self._params(req, tools)
        except ValueError as exc:  # template errors too
            raise bad_request(exc, "messages") from None
        if blended is not None:
            if tools.active:
                raise invalid("tools", "tools do not combine with blended chunks")
            return await self.run(request, req, [blended[0]], params, **blended[1])
        try:
            prompt = await encode_beside_loop(functools.partial(self.encode, messages, tools), long_messages(messages))
        except ValueError as exc:  # template errors
            raise bad_request(exc, "messages") from None
        return await self.run(request, req, [prompt], params)

    def encode(
        self, messages: list[dict], tools: ToolRequest, add_generation_prompt: bool = True, budget: int | None = None
    ) -> list[int]:
        """The prompt's token ids: the chat template with the tools (also what /tokenize returns); `budget` as for
        PromptTokenizer.encode."""
        messages, kw = render_messages(messages, tools, self.parser, self.tokenizer.chat_template or "")
        return self.tokenizer.encode_chat(messages, add_generation_prompt, budget=budget, **kw)

    def _tools(self, req: ChatCompletionRequest) -> ToolRequest:
        return tool_request(req.tools, req.tool_choice, req.parallel_tool_calls)

    def _params(self, req: ChatCompletionRequest, tools: ToolRequest):
        params, forced = req.to_sampling_params(), forced_grammar(tools, self.parser)
        if tools.active and self.parser.special_markers:  # the parser must see its marker tokens (as vLLM's)
            params = dataclasses.replace(params, skip_special_tokens=False)
        if forced is None:
            return params
        if params.guided is not None:
            raise ApiError(400, f"tool_choice {tools.choice!r} does not combine with {params.guided.param}",
                           "invalid_value", "tool_choice")  # fmt: skip
        return dataclasses.replace(params, guided=forced)

    def _message(self, text: str, tools: ToolRequest) -> tuple[dict, list[ToolCall]]:
        content, calls = self.parser.extract(text) if tools.active else (text, [])
        calls = tools.calls(calls)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.to_dict() for c in calls]
        return message, calls

    def _logprobs(self, req: ChatCompletionRequest) -> LogprobFormatter | None:
        return LogprobFormatter(self.tokenizer, req.top_logprobs or 0) if req.logprobs else None

    def response(self, req, prompts, finals: dict[int, RequestOutput], header: dict) -> dict:
        fmt, out, tools = self._logprobs(req), finals[0], self._tools(req)
        holdback = stop_holdback(req.stop_strings)
        choices = []
        for c in out.outputs:
            message, calls = self._message(unsent_text(out.resumed_text, c.text, holdback), tools)
            choice = {
                "index": c.index,
                "message": message,
                "logprobs": fmt.chat(c.token_ids, c.logprobs or []) if fmt else None,
                "finish_reason": "tool_calls" if calls else c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            choices.append(choice | ({"token_ids": c.token_ids} if req.return_token_ids else {}))
        return {**header, "choices": choices, "usage": usage(finals)}

    async def chunks(self, gen, req: ChatCompletionRequest, prompts, last: dict):
        fmt, ids, tools = self._logprobs(req), req.return_token_ids, self._tools(req)
        streams: dict[int, ToolStream] = {}
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
                calls: list[dict] = []
                if tools.active:
                    stream = streams.setdefault(c.index, ToolStream(self.parser, tools))
                    delta, calls = stream.feed(delta, c.finished)
                if c.finished:
                    done.add(c.index)
                elif not delta and not calls and not ((fmt or ids) and tokens):
                    continue
                logprobs = fmt.chat(tokens, entries) if fmt else None
                delta = ({"content": delta} if delta else {}) | ({"tool_calls": calls} if calls else {})
                finish = "tool_calls" if c.finished and c.index in streams and streams[c.index].called else None
                yield _chunk(c.index, delta, logprobs, finish or c.finish_reason, tokens if ids else None)


def _chunk(
    index: int,
    delta: dict,
    logprobs: dict | None = None,
    finish_reason: str | None = None,
    token_ids: list[int] | None = None,
) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"choices": [choice | ({"token_ids": token_ids} if token_ids is not None else {})]}
