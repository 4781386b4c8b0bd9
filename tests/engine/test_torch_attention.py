"""The batched torch attention backend: exact against float64 per-sequence attention, constant calls per layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ragserve_engine.attention import torch_ref
from ragserve_engine.attention.paged_batch import make_paged_batch
from ragserve_engine.attention.torch_ref import TorchAttentionBackend

CASES = {
    "mixed": [(1, 37), (5, 18), (17, 129), (1, 5)],  # decodes, a cached-prefix chunk, a long chunk
    "decodes-ragged": [(1, 37), (1, 5), (1, 64), (1, 16)],
    "decodes-long-and-short": [(1, 300), (1, 9), (1, 250), (1, 40), (4, 60)],  # three decode length bands
    "decodes-equal": [(1, 40)] * 3,
    "fresh-prefills": [(9, 9), (3, 3), (1, 40)],
    "one-fresh-prefill": [(17, 17)],
    "prefill-and-chunk": [(30, 30), (4, 50)],
}


def naive_attention(batch, cache, scale: float) -> torch.Tensor:
    """Each sequence alone, in float64, keys read back from the cache (the oracle)."""
    out = torch.zeros_like(batch.query, dtype=torch.float64)
    starts = batch.meta.query_start_loc_cpu
    for i, ctx in enumerate(batch.meta.seq_lens_cpu):
        k, v = TorchAttentionBackend().gather_kv(cache, batch.meta.block_tables[i], ctx)
        q = batch.query[starts[i] : starts[i + 1]].double()
        group = q.shape[1] // k.shape[1]
        k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        last_visible = torch.arange(q.shape[0])[:, None] + ctx - q.shape[0]
        scores = scores.masked_fill(torch.arange(ctx)[None] > last_visible, float("-inf"))
        out[starts[i] : starts[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("name", list(CASES))
def test_batched_matches_per_sequence(name, kv_dtype):
    batch = make_paged_batch(CASES[name], num_heads=6, num_kv_heads=2, head_dim=32, block_size=16,
                             kv_dtype=kv_dtype, pad_tokens=3)  # fmt: skip
    backend, cache, scale = TorchAttentionBackend(), batch.cache(), 32**-0.5
    backend.write_kv(batch.key, batch.value, cache, batch.meta.slot_mapping)
    out = backend.forward(batch.query, batch.key, batch.value, cache, batch.meta, scale)
    n = batch.num_real_tokens
    err = (out[:n].double() - naive_attention(batch, cache, scale)[:n]).abs().max().item()
    assert err < 1e-5, err


def test_constant_calls_per_layer(monkeypatch):
    """32 decodes plus two prefill chunks: two SDPA calls per layer, and the plan is built once per step."""
    calls, plans = [], []
    real_sdpa, real_plan = F.scaled_dot_product_attention, torch_ref.plan_groups
    monkeypatch.setattr(
        torch_ref.F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real_sdpa(*a, **k)
    )
    monkeypatch.setattr(torch_ref, "plan_groups", lambda *a: plans.append(1) or real_plan(*a))
    cases = [(1, 20 + i) for i in range(32)] + [(7, 7), (5, 40)]
    batch = make_paged_batch(cases, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, num_layers=3)
    backend = TorchAttentionBackend()
    for layer, cache in enumerate(batch.kv_cache.layers()):
        backend.write_kv(batch.key, batch.value, cache, batch.meta.slot_mapping)
        backend.forward(batch.query, batch.key, batch.value, cache, batch.meta, 0.25)
        assert len(calls) == 2 * (layer + 1)
    assert len(plans) == 1


def test_decodes_grouped_by_context_length():
    """A long-context decode (a RAG answer) beside short chats: the chats are not padded to its keys."""
    batch = make_paged_batch([(1, 1000), (1, 30), (1, 40), (1, 900), (6, 6)], num_heads=4, num_kv_heads=2,
                             head_dim=16, block_size=16)  # fmt: skip
    groups = torch_ref.plan_groups(batch.meta, 16, quantized=False)
    assert sorted((g.key_len, len(g.token_idx)) for g in groups) == [(6, 1), (40, 2), (1000, 2)]
