"""POST /v1/completions: text or token-id prompts (batched), `echo`, text_completion objects."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from ragserve.http.errors import ApiError
from ragserve_engine.engine_client import CompletionOutput, RequestOutput
from ragserve_engine.server.errors import bad_request
from ragserve_engine.server.logprobs import LogprobFormatter
from ragserve_engine.server.protocol import CompletionRequest
from ragserve_engine.server.serving_base import OpenAIServing, stop_holdback, usage
from ragserve_engine.server.streaming import ChoiceCursor, unsent_text


class CompletionServing(OpenAIServing):
    object_name = "text_completion"
    chunk_object = "text_completion"
    prompt_param = "prompt"
    id_prefix = "cmpl"

    async def create(self, request: Request, req: CompletionRequest) -> Response:
        self.server.check_model(req.model)
        try:
            params = req.to_sampling_params()
        except ValueError as exc:
            raise bad_request(exc) from None
        prompts = req.prompts()
        if req.resumed and len(prompts) > 1:
            raise ApiError(400, "resume_token_ids needs a single prompt", "invalid_value", "resume_token_ids")
        if req.first_token_id is not None and len(prompts) > 1:
            raise ApiError(400, "first_token_id needs a single prompt", "invalid_value", "first_token_id")
        # strings go to the engine as they are: it encodes them exactly like the router does
        return await self.run(request, req, prompts, params)

    def _logprobs(self, req: CompletionRequest) -> LogprobFormatter | None:
        return LogprobFormatter(self.tokenizer, req.logprobs) if req.logprobs is not None else None

    def _prompt_text(self, prompt: str | list[int]) -> str:
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt, skip_special_tokens=False)

    def _echo(self, fmt: LogprobFormatter | None, out: RequestOutput, text: str) -> tuple[str, dict | None]:
        """The echoed prompt and its logprobs (the first token has none)."""
        if fmt is None:
            return text, None
        entries = list(out.prompt_logprobs or [])
        entries = [None] * (len(out.prompt_token_ids) - len(entries)) + entries
        logprobs, _ = fmt.completion(out.prompt_token_ids, entries, 0)
        return text, logprobs

    def _choice(
        self,
        index: int,
        text: str,
        fmt: LogprobFormatter | None,
        c: CompletionOutput,
        tokens: list[int],
        entries: list,
        echo: tuple[str, dict | None] | None = None,
        finished: bool = True,
        offset: int = 0,
        token_ids: bool = False,
    ) -> dict:
        """One choice; `offset` is where this piece starts in the choice's whole text (streaming)."""
        prefix, prompt_lp = echo or ("", None)
        logprobs = None
        if fmt:
            logprobs, _ = fmt.completion(tokens, entries, offset + len(prefix))
            if prompt_lp:
                logprobs = {k: prompt_lp[k] + logprobs[k] for k in logprobs}
        choice = {
            "index": index,
            "text": prefix + text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason if finished else None,
            "stop_reason": c.stop_reason if finished else None,
        }
        return choice | ({"token_ids": list(tokens)} if token_ids else {})

    def response(self, req: CompletionRequest, prompts, finals: dict[int, RequestOutput], header: dict) -> dict:
        fmt, ids = self._logprobs(req), req.return_token_ids
        choices = []
        holdback = stop_holdback(req.stop_strings)
        for i, out in sorted(finals.items()):
            echo = self._echo(fmt, out, self._prompt_text(prompts[i])) if req.echo and not req.resumed else None
            for c in out.outputs:
                index = i * req.n + c.index
                text = unsent_text(out.resumed_text, c.text, holdback)
                choice = self._choice(index, text, fmt, c, c.token_ids, c.logprobs or [], echo, True, 0, ids)
                choices.append(choice)
        return {**header, "choices": choices, "usage": usage(finals)}

    async def chunks(self, gen, req: CompletionRequest, prompts, last: dict):
        fmt, ids = self._logprobs(req), req.return_token_ids
        holdback = stop_holdback(req.stop_strings)
        cursors: dict[int, ChoiceCursor] = {}
        offsets: dict[int, int] = {}
        done: set[int] = set()
        async for i, out in gen.outputs():
            last[i] = out
            for c in out.outputs:
                index = i * req.n + c.index
                if index in done or not (c.token_ids or c.finished):
                    continue  # a prefill chunk: nothing to say yet
                echo = None
                if index not in cursors:
                    cursors[index] = ChoiceCursor(holdback, out.resumed_text)
                    echo = self._echo(fmt, out, self._prompt_text(prompts[i])) if req.echo and not req.resumed else None
                delta, tokens, entries = cursors[index].advance(c)
                if c.finished:
                    done.add(index)
                elif not delta and not echo and not ((fmt or ids) and tokens):
                    continue
                offset = offsets.get(index, 0)
                choice = self._choice(index, delta, fmt, c, tokens, entries, echo, c.finished, offset, ids)
                offsets[index] = offset + len(choice["text"])
                yield {"choices": [choice]}
