"""The sampling half of a step: one token for every sequence of the requests the step sampled. Fork an n > 1
request's children once its prompt is in, mask constrained rows to their grammars, sample (plain greedy rows in one
call), append each token with the tokens its grammar forces, and check the stop conditions. A failure fails only its
own request (`guard`: LLMEngine._guard)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ragserve_engine.kv_cache_manager import KVCacheManager
from ragserve_engine.sampler import Sampler, SampleResult, SamplingRow, is_plain_greedy
from ragserve_engine.sequence import Request, Sequence
from ragserve_engine.stop import StopCriteria, check_stop
from ragserve_engine.structured.grammar import GrammarCompiler


@dataclass
class SampleStep:
    sampler: Sampler
    grammars: GrammarCompiler
    stop_criteria: StopCriteria
    kv_manager: KVCacheManager
    device: torch.device
    jump_forward: bool  # --enable-jump-forward
    guard: Callable[..., None]  # guard(req, fn, *args): fn(*args), failing req alone if it raises
    requests: dict[str, Request]  # the engine's, by id

    def _expand_forks(self, req: Request, rows: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """n > 1: once the prompt is prefilled, fork n - 1 children sharing its blocks (and its logits row)."""
        if not req.needs_fork:
            return rows
        (parent, row), seed = rows[0], req.params.seed
        for i in range(1, req.params.n):
            child = self.kv_manager.fork(parent)
            child.index = i
            if seed is not None:
                child.generator = torch.Generator(device=self.device).manual_seed(seed + i)
            req.seqs.append(child)
        req.needs_fork = False
        return [(seq, row) for seq in req.seqs]

    def __call__(self, batch: list[tuple[Request, list[tuple[Sequence, int]]]], logits: torch.Tensor) -> None:
        """One token for every sequence of the step's sampling requests. Plain greedy requests share one
        sampler call (one argmax); the rest sample one request at a time (their generators draw only for
        themselves), so a failure, or the shared call's failing, fails only the requests it belongs to."""
        ready: list[tuple[Request, list[tuple[Sequence, int, SamplingRow]]]] = []
        for req, rows in batch:
            self.guard(req, lambda r, rs: ready.append((r, self._sampling_rows(r, rs))), req, rows)
        ready = self._apply_grammars(ready, logits)
        plain = []
        for req, rows in ready:
            if all(is_plain_greedy(s) for *_, s in rows):
                plain.append((req, rows))
            else:
                self.guard(req, self._sample_request, req, rows, logits)
        flat = [(req, seq, row, s) for req, rows in plain for seq, row, s in rows]
        if not flat:
            return
        try:
            results = self.sampler(_take_rows(logits, [f[2] for f in flat]), [f[3] for f in flat])
        except Exception:
            for req, rows in plain:
                self.guard(req, self._sample_request, req, rows, logits)
            return
        for (req, seq, _, _), res in zip(flat, results, strict=True):
            self.guard(req, self._append_token, req, seq, res)

    def _apply_grammars(self, ready: list, logits: torch.Tensor) -> list:
        """Mask the constrained rows to what their grammars allow, in one pass over the batch; if that fails,
        the constrained requests fail (the others carry on)."""
        rows = {row: seq.matcher for _, rs in ready for seq, row, _ in rs if seq.matcher is not None}
        if not rows:
            return ready
        try:
            self.grammars.apply(logits, list(rows), list(rows.values()))
            return ready
        except Exception as exc:
            constrained = {req.request_id for req, rs in ready if any(seq.matcher for seq, *_ in rs)}
            for rid in constrained:
                self.guard(self.requests[rid], _raise, exc)
            return [(req, rs) for req, rs in ready if req.request_id not in constrained]

    def _sampling_rows(self, req: Request, rows: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int, SamplingRow]]:
        out = []
        for seq, row in self._expand_forks(req, rows):
            short = len(seq.output_token_ids) - req.num_resumed_tokens < req.params.min_tokens
            blocked = sorted(self.stop_criteria.eos_ids | set(req.params.stop_token_ids)) if short else []
            out.append((seq, row, SamplingRow(req.params, req.prompt_token_ids, seq.output_token_ids, seq.generator,
                                              blocked)))  # fmt: skip
        return out

    def _sample_request(self, req: Request, rows: list[tuple[Sequence, int, SamplingRow]], logits: torch.Tensor):
        results = self.sampler(_take_rows(logits, [row for _, row, _ in rows]), [s for *_, s in rows])
        for (seq, _, _), res in zip(rows, results, strict=True):
            self._append_token(req, seq, res)

    def _append_token(self, req: Request, seq: Sequence, res: SampleResult) -> None:
        seq.token_ids.append(res.token_id)
        seq.cumulative_logprob += res.logprob
        if res.top_logprobs is not None:
            seq.logprobs.append(res.top_logprobs)
        if seq.matcher is not None and not seq.matcher.consume_token(res.token_id):
            raise RuntimeError(f"the grammar rejected token {res.token_id}: {seq.matcher.get_error()}")
        self._after_token(req, seq)
        if self._jumps_forward(req, seq):
            for token in seq.matcher.compute_ff_tokens():
                if seq.finished or not seq.matcher.consume_token(token):
                    break
                seq.token_ids.append(token)
                self._after_token(req, seq)

    def _after_token(self, req: Request, seq: Sequence) -> None:
        check_stop(req, seq, self.stop_criteria)
        if not seq.finished and seq.matcher is not None and seq.matcher.is_stopped():
            seq.finish_reason = "stop"  # the grammar is complete: nothing but EOS could follow
        if seq.finished and seq.blocks:
            self.kv_manager.free(seq)

    def _jumps_forward(self, req: Request, seq: Sequence) -> bool:
        """Jump-forward (docs/api.md#jump-forward): the tokens the grammar forces (each the only one its mask
        allows) are appended unsampled; the scheduler computes them next step with the sampled one, like a
        prefill chunk. Not with logprobs (a forced token has none) nor n > 1 (forks step together)."""
        p = req.params
        return (
            self.jump_forward and seq.matcher is not None and not seq.finished
            and p.logprobs is None and p.n == 1
        )  # fmt: skip


def _raise(exc: Exception) -> None:
    raise exc


def _take_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows], without a copy when rows are all of them in order (a decode step's usual case)."""
    if rows == list(range(logits.shape[0])):
        return logits
    return logits[torch.tensor(rows, device=logits.device)]
