"""Sampler: penalties, temperature, top-k / top-p / min-p, seeded per-request sampling, logprobs.

A random row draws one uniform number u from the request's own generator (so a seeded request samples the same
tokens whatever its batch mates) and takes the first token whose cumulative probability (float64) passes u: inverse
transform sampling, one draw a token. (The exponential race, argmax of p / q with q ~ Exp(1), needs a draw per
vocabulary entry: ~1 ms a row on a CPU for a 49k vocabulary, half a decode step of a small model.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragserve_engine.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None
    blocked_ids: list[int]  # e.g. EOS while min_tokens is not reached


@dataclass
class SampleResult:
    token_id: int
    logprob: float
    top_logprobs: dict[int, float] | None


def apply_penalties(logits: torch.Tensor, row: SamplingRow) -> None:
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), dtype=torch.long, device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if row.output_ids and (p.presence_penalty or p.frequency_penalty):
        out = torch.tensor(row.output_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(out, minlength=logits.shape[-1]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks on one row."""
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > p.top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def top_logprobs(logprobs: torch.Tensor, k: int, token_id: int, also: list[int] = ()) -> dict[int, float]:
    """The chosen token's logprob, the k most likely tokens' and those of the `also` ids."""
    out = {t: float(logprobs[t]) for t in (token_id, *also)}
    if k:
        vals, idx = torch.topk(logprobs, k)
        out.update({int(i): float(v) for i, v in zip(idx, vals, strict=True)})
    return out


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampleResult]:
        """One token per row. Plain greedy rows are one batched argmax; each row's logprob is its logit less
        the row's logsumexp (one pass, no [rows, vocab] result); full log-softmax only for rows asking for
        top logprobs."""
        logits = logits.float()
        plain = [is_plain_greedy(row) for row in rows]
        if all(plain):
            tokens = torch.argmax(logits, dim=-1)
        else:
            tokens = torch.zeros(len(rows), dtype=torch.long, device=logits.device)
            greedy = [i for i, p in enumerate(plain) if p]
            if greedy:
                idx = torch.tensor(greedy, device=logits.device)
                tokens[idx] = torch.argmax(logits[idx], dim=-1)
            for i, row in enumerate(rows):
                if not plain[i]:
                    tokens[i] = self._sample_row(logits[i].clone(), row)
        chosen = (logits.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)).tolist()
        token_ids = tokens.tolist()
        results = [SampleResult(t, lp, None) for t, lp in zip(token_ids, chosen, strict=True)]
        asked = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        if asked:
            logprobs = torch.log_softmax(logits[torch.tensor(asked, device=logits.device)], dim=-1)
            for lp, i in zip(logprobs, asked, strict=True):
                p = rows[i].params
                top = top_logprobs(lp, p.logprobs, token_ids[i], p.logprob_token_ids)
                results[i] = SampleResult(token_ids[i], top[token_ids[i]], top)
        return results

    def _sample_row(self, logits: torch.Tensor, row: SamplingRow) -> int:
        p = row.params
        if p.needs_penalties:
            apply_penalties(logits, row)
        if row.blocked_ids:
            logits[row.blocked_ids] = float("-inf")
        if p.greedy:
            return int(torch.argmax(logits))
        probs = filter_logits(logits, p).softmax(-1).double()
        return inverse_transform(probs, draw(row.generator, probs.device))


def draw(generator: torch.Generator | None, device: torch.device | str = "cpu") -> torch.Tensor:
    """The one uniform number a random row takes per token (LLMEngine._fast_forward draws the same)."""
    return torch.rand(1, dtype=torch.float64, generator=generator, device=device)


def inverse_transform(probs: torch.Tensor, u: torch.Tensor) -> int:
    """The first token whose cumulative probability exceeds u x the total; a zero-probability token never."""
    cum = probs.cumsum(-1)
    token = int(torch.searchsorted(cum, u * cum[-1], right=True))
    if token >= probs.shape[-1] or probs[token] <= 0:  # u x total rounded up to the total
        token = int(torch.nonzero(probs)[-1])
    return token


def is_plain_greedy(row: SamplingRow) -> bool:
    """Greedy without penalties or blocked tokens: a row of the batched argmax (no generator draws)."""
    return row.params.greedy and not row.params.needs_penalties and not row.blocked_ids
