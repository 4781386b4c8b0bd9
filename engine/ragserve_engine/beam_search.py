"""Beam search over a request's live sequences; beams share KV blocks copy-on-write."""

from __future__ import annotations

import torch

from ragserve_engine.kv_cache_manager import KVCacheManager
from ragserve_engine.sequence import Request, Sequence
from ragserve_engine.stop import StopCriteria


def _score(seq: Sequence, length_penalty: float) -> float:
    return seq.cumulative_logprob / max(1, len(seq.output_token_ids)) ** length_penalty


def beam_step(
    req: Request, rows: list[tuple[Sequence, torch.Tensor]], kv_manager: KVCacheManager, criteria: StopCriteria
) -> None:
    p, width = req.params, req.params.beam_width
    seqs = [seq for seq, _ in rows]
    logprobs = torch.log_softmax(torch.stack([lg.float() for _, lg in rows]), dim=-1)
    if p.temperature and p.temperature != 1.0:
        logprobs = torch.log_softmax(logprobs / p.temperature, dim=-1)
    vocab = logprobs.shape[-1]
    cum = torch.tensor([s.cumulative_logprob for s in seqs]).unsqueeze(1)
    scores, flat = torch.topk((cum + logprobs).flatten(), min(2 * width, logprobs.numel()))
    stop_ids = set() if p.ignore_eos else criteria.eos_ids | set(p.stop_token_ids)
    chosen: list[tuple[int, int, float]] = []
    for score, idx in zip(scores.tolist(), flat.tolist(), strict=True):
        beam, token = divmod(idx, vocab)
        if token in stop_ids and len(seqs[beam].output_token_ids) + 1 >= p.min_tokens:
            if len(chosen) < width:
                _finish_hypothesis(req, seqs[beam], token, score)
            continue
        chosen.append((beam, token, score))
        if len(chosen) == width:
            break
    req.seqs = _advance(kv_manager, seqs, chosen)
    req.needs_fork = False
    if _done(req, criteria.max_model_len):
        _finalize(req, kv_manager, criteria)


def _finish_hypothesis(req: Request, parent: Sequence, token: int, score: float) -> None:
    hyp = Sequence(parent.token_ids + [token], parent.num_prompt_tokens)
    hyp.cumulative_logprob, hyp.finish_reason = score, "stop"
    req.beam_finished.append(hyp)


def _advance(kv_manager: KVCacheManager, seqs: list[Sequence], chosen: list[tuple[int, int, float]]) -> list[Sequence]:
    """Children of each beam: the first reuses the beam, the others fork it before appending."""
    nxt: list[Sequence] = []
    for i, seq in enumerate(seqs):
        kids = [(tok, score) for beam, tok, score in chosen if beam == i]
        if not kids:
            kv_manager.free(seq)
            continue
        forks = [kv_manager.fork(seq) for _ in kids[1:]]
        for s, (tok, score) in zip([seq, *forks], kids, strict=True):
            s.token_ids.append(tok)
            s.cumulative_logprob = score
            nxt.append(s)
    return nxt


def _done(req: Request, max_model_len: int) -> bool:
    p = req.params
    if not req.seqs:
        return True
    lead = req.seqs[0]
    if len(lead.output_token_ids) >= p.max_tokens or lead.num_tokens >= max_model_len:
        for seq in req.seqs:
            seq.finish_reason = "length"
        req.beam_finished += req.seqs
        return True
    if len(req.beam_finished) < p.beam_width:
        return False
    worst_kept = sorted((_score(h, p.length_penalty) for h in req.beam_finished), reverse=True)[p.beam_width - 1]
    best_running = max(s.cumulative_logprob for s in req.seqs) / len(lead.output_token_ids) ** p.length_penalty
    return worst_kept >= best_running


def _finalize(req: Request, kv_manager: KVCacheManager, criteria: StopCriteria) -> None:
    for seq in req.seqs:
        if seq.blocks:
            kv_manager.free(seq)
        seq.finish_reason = seq.finish_reason or "length"
    best = sorted(req.beam_finished, key=lambda h: _score(h, req.params.length_penalty), reverse=True)
    req.seqs = best[: req.params.n]
    for i, seq in enumerate(req.seqs):
        seq.index = i
        ids = seq.output_token_ids
        if seq.finish_reason == "stop" and ids and ids[-1] in criteria.eos_ids:
            ids = ids[:-1]
        seq.output_text = criteria.tokenizer.decode(ids)
