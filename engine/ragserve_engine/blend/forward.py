"""The blended forward: the model's own layers, run over a shrinking set of rows.

Rows are the prompt's tokens. Layers before `check_layer` compute every row (layer 0's K/V do not
depend on context, so they are exact). At `check_layer` every row's K/V is fresh; the reusable rows
whose keys deviate most from their stored keys join the rows that are always computed (non-chunk
tokens), and only those rows go on: later layers compute their hidden states, Q and K/V and take
the stored K/V for every other row (CacheBlend, EuroSys '25). With no plan every row is computed
at every layer: a plain causal prefill.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ragserve_engine.models.llama import LlamaForCausalLM

KVSink = Callable[[int, torch.Tensor, torch.Tensor], None]  # (layer, K [N, kvh, d], V) of every row


@dataclass
class ReusePlan:
    old_kv: torch.Tensor  # [num_layers, 2, N, kvh, d]: stored chunk K/V, keys at their real positions
    reusable: torch.Tensor  # [N] bool: rows that have stored K/V (chunk tokens)
    num_recompute: int  # how many reusable rows to recompute, chosen by key deviation at check_layer
    check_layer: int = 1


def blend_forward(
    model: LlamaForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor, plan: ReusePlan | None, sink: KVSink
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (final hidden states of the rows computed at the last layer, their row indices)."""
    rows = torch.arange(len(input_ids), device=input_ids.device)
    x, residual = model.embed_tokens(input_ids), None
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        if residual is None:
            residual, h = x, layer.input_layernorm(x)
        else:
            h, residual = layer.input_layernorm(x, residual)
        q, k, v = attn.project(positions[rows], h)
        if plan is not None and i == plan.check_layer:
            keep = select_rows(k, plan.old_kv[i, 0], plan.reusable, plan.num_recompute)
            q, residual, rows = q[keep], residual[keep], rows[keep]
        elif plan is not None and i > plan.check_layer:
            k, v = _merge(plan.old_kv[i, 0], k, rows), _merge(plan.old_kv[i, 1], v, rows)
        sink(i, k, v)
        out = attend(q, k, v, positions[rows], positions, attn.scale)
        x = attn.o_proj(out.reshape(len(rows), -1))
        x, residual = layer.post_attention_layernorm(x, residual)
        x = layer.mlp(x)
    x, _ = model.norm(x, residual)
    return x, rows


def select_rows(k: torch.Tensor, old_k: torch.Tensor, reusable: torch.Tensor, num_recompute: int) -> torch.Tensor:
    """Sorted row indices: every non-reusable row plus the num_recompute reusable rows of largest key deviation."""
    deviation = (k.float() - old_k.float()).pow(2).sum(dim=(-2, -1))
    deviation = deviation.masked_fill(~reusable, float("inf"))
    count = min(len(k), int((~reusable).sum()) + num_recompute)
    return deviation.topk(count).indices.sort().values


def _merge(old: torch.Tensor, fresh: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    out = old.clone()
    out[rows] = fresh
    return out


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of some rows' queries ([A, H, D]) over every row's K/V ([N, kvh, D]) by position."""
    full = len(q) == len(k)
    mask = None if full else k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None].to(q.dtype), v.transpose(0, 1)[None].to(q.dtype),
        attn_mask=mask, is_causal=full and len(q) > 1, scale=scale, enable_gqa=True,
    )  # fmt: skip
    return out[0].transpose(0, 1)
