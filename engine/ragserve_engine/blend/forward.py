"""The blended forward: the model's own layers, run over a shrinking set of rows.

Rows are the prompt's tokens. Layers before `check_layer` compute every row (layer 0's K/V do not
depend on context, so they are exact). At `check_layer` every row's K/V is fresh; the reusable rows
whose keys deviate most from their stored keys join the rows that are always computed (non-chunk
tokens), and only those rows go on: later layers compute their hidden states, Q and K/V and take
the stored K/V for every other row (CacheBlend, EuroSys '25). With no plan every row is computed
at every layer: a plain causal prefill.
"""

from __future__ import annotations

import math
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
    num_recompute: int  # how many reusable rows to recompute in the end, chosen by KV deviation
    check_layer: int = 1
    filter_layers: int = 1  # gradual filtering: select at this many layers from check_layer on...
    filter_start: float = 1.0  # ...keeping filter_start x num_recompute rows at the first, num_recompute at the last
    value_weight: float = 0.0  # deviation: key distance + value_weight x value distance (see deviation)
    fresh: torch.Tensor | None = None  # [N] bool: rows of chunks computed for this request (usage only)

    def keep_at(self, layer: int) -> int | None:
        """Reusable rows kept by the selection at `layer`; None where no selection happens."""
        j = layer - self.check_layer
        if not 0 <= j < self.filter_layers:
            return None
        steps = max(1, self.filter_layers - 1)
        factor = self.filter_start + (1.0 - self.filter_start) * min(j, steps) / steps
        return math.ceil(self.num_recompute * (factor if self.filter_layers > 1 else 1.0))


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
        if plan is not None and len(rows) < len(input_ids):
            k, v = _merge(plan.old_kv[i, 0], k, rows), _merge(plan.old_kv[i, 1], v, rows)
        keep_count = plan.keep_at(i) if plan is not None else None
        if keep_count is not None:  # rows not kept still use this layer's fresh K/V
            old = plan.old_kv[i][:, rows]
            dev = deviation(k[rows], v[rows], old[0], old[1], plan.value_weight)
            keep = select_rows(dev, plan.reusable[rows], keep_count)
            q, residual, rows = q[keep], residual[keep], rows[keep]
        sink(i, k, v)
        out = attend(q, k, v, positions[rows], positions, attn.scale)
        x = attn.o_proj(out.reshape(len(rows), -1))
        x, residual = layer.post_attention_layernorm(x, residual)
        x = layer.mlp(x)
    x, _ = model.norm(x, residual)
    return x, rows


def deviation(
    k: torch.Tensor, v: torch.Tensor, old_k: torch.Tensor, old_v: torch.Tensor, value_weight: float
) -> torch.Tensor:
    """Per row ([N, kvh, d] in, [N] out): squared distance of fresh from stored keys, plus value_weight x that
    of values; each scaled by the stored rows' mean squared norm, so keys and values weigh alike."""

    def dist(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        old = old.float()
        d = (new.float() - old).pow(2).sum(dim=(-2, -1))
        return d / old.pow(2).sum(dim=(-2, -1)).mean().clamp_min(1e-12)

    dev = dist(k, old_k)
    return dev + value_weight * dist(v, old_v) if value_weight else dev


def select_rows(deviation: torch.Tensor, reusable: torch.Tensor, num_recompute: int) -> torch.Tensor:
    """Sorted row indices: every non-reusable row plus the num_recompute reusable rows of largest deviation."""
    deviation = deviation.masked_fill(~reusable, float("inf"))
    count = min(len(deviation), int((~reusable).sum()) + num_recompute)
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
