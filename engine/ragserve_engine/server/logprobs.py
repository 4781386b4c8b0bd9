"""Logprobs in OpenAI's shapes: chat `logprobs.content[]`, completions `logprobs.{tokens,...}`."""

from __future__ import annotations

from ragserve.tokenizer import PromptTokenizer

MIN_LOGPROB = -9999.0  # JSON has no -inf


def _clip(value: float) -> float:
    return max(value, MIN_LOGPROB)


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:k]


class LogprobFormatter:
    def __init__(self, tokenizer: PromptTokenizer, top_k: int) -> None:
        self.tokenizer = tokenizer
        self.top_k = top_k

    def token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def chat(self, token_ids: list[int], entries: list[dict[int, float]]) -> dict:
        content = []
        for token_id, entry in zip(token_ids, entries, strict=False):
            text = self.token(token_id)
            tops = [self._chat_entry(t, lp) for t, lp in _top(entry, self.top_k)]
            content.append({**self._chat_entry(token_id, entry[token_id], text), "top_logprobs": tops})
        return {"content": content}

    def _chat_entry(self, token_id: int, logprob: float, text: str | None = None) -> dict:
        text = self.token(token_id) if text is None else text
        return {"token": text, "logprob": _clip(logprob), "bytes": list(text.encode())}

    def completion(
        self, token_ids: list[int], entries: list[dict[int, float] | None], text_offset: int
    ) -> tuple[dict, int]:
        """Completions logprobs for these tokens; entries[i] None means unknown (the first prompt token).

        Returns the logprobs object and the text offset after the last token.
        """
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, entry in zip(token_ids, entries, strict=False):
            text = self.token(token_id)
            out["tokens"].append(text)
            out["text_offset"].append(text_offset)
            text_offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_clip(entry[token_id]))
            out["top_logprobs"].append({self.token(t): _clip(lp) for t, lp in _top(entry, self.top_k)})
        return out, text_offset
