"""The C++ CPU ops (compilation/cpu_ops.py): the paged decode attention computes what paged_decode_attention
(the inductor path it replaces in CPU decode graphs) computes: random caches, non-contiguous block ids,
several context lengths, padding rows, grouped query heads; a compiled graph calls it; packed_linear's
C++ kernel gives the Python kernel's result."""

from __future__ import annotations

import pytest
import torch

from ragserve_engine.compilation import cpu_ops
from ragserve_engine.compilation.graph_attention import paged_decode_attention
from ragserve_engine.layers.packed_linear import PackedLinear

LAYERS, BLOCK, KVH, D = 3, 16, 3, 64


@pytest.fixture(scope="module")
def op():
    assert cpu_ops.load()  # a C++ compiler is part of the engine's requirements (inductor needs one)
    return torch.ops.ragserve.paged_decode_attention


def _case(seq_lens: list[int], heads: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A cache of shuffled blocks: sequence i owns a random, non-contiguous set of block ids."""
    g = torch.Generator().manual_seed(seed)
    b, width = len(seq_lens), max(2, -(-max(seq_lens) // BLOCK))
    num_blocks = b * width + 5
    kv = torch.randn(num_blocks, LAYERS, 2, BLOCK, KVH, D, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[: b * width].view(b, width)
    q = torch.randn(b, heads, D, generator=g).to(dtype)
    k, v = (torch.randn(b, KVH, D, generator=g).to(dtype) for _ in range(2))
    return q, k, v, kv, tables, torch.tensor(seq_lens, dtype=torch.int64)


@pytest.mark.parametrize("heads", [3, 9])  # G = 1 and G = 3 query heads per KV head
def test_matches_paged_decode_attention(op, heads):
    seq_lens = [1, 2, 15, 16, 17, 33, 100, 1, 160]  # 1: a padding row (its own token only)
    q, k, v, kv, tables, lens = _case(seq_lens, heads)
    for layer in range(LAYERS):
        want = paged_decode_attention(q, k, v, kv[:, layer], tables, lens, D**-0.5)
        got = op(q, k, v, kv, layer, tables, lens, D**-0.5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[0], v[0].repeat_interleave(heads // KVH, dim=0))  # padding row: its own value


def test_reads_only_the_table_and_length(op):
    """Blocks past a sequence's length, and blocks no table names, do not change its output."""
    q, k, v, kv, tables, lens = _case([20, 40], heads=9, seed=1)
    before = op(q, k, v, kv, 1, tables, lens, 0.125)
    named = set(tables[0, :2].tolist()) | set(tables[1, :3].tolist())
    other = torch.tensor([i for i in range(kv.shape[0]) if i not in named])
    kv[other] = 1e4
    kv[tables[0, 1], :, :, 3:] = -1e4  # rows 19.. of sequence 0: past its 19 cached tokens
    torch.testing.assert_close(op(q, k, v, kv, 1, tables, lens, 0.125), before, rtol=0, atol=0)


def test_bfloat16(op):
    q, k, v, kv, tables, lens = _case([5, 50, 1], heads=9, dtype=torch.bfloat16, seed=2)
    want = paged_decode_attention(q, k, v, kv[:, 2], tables, lens, 0.125)
    torch.testing.assert_close(op(q, k, v, kv, 2, tables, lens, 0.125), want, rtol=2e-2, atol=2e-2)


def test_compiled_graph_calls_the_kernel(op):
    """Under torch.compile with the C++ wrapper the op is an extern kernel (fake impl for its shape)."""
    q, k, v, kv, tables, lens = _case([7, 30, 1, 64], heads=9, seed=3)

    def fn(q, k, v, kv, tables, lens):
        return op(q * 2, k, v, kv, 2, tables, lens, 0.125) + 1

    compiled = torch.compile(fn, fullgraph=True, options={"cpp_wrapper": True})
    want = paged_decode_attention(q * 2, k, v, kv[:, 2], tables, lens, 0.125) + 1
    torch.testing.assert_close(compiled(q, k, v, kv, tables, lens), want, rtol=1e-5, atol=1e-5)


def test_packed_linear_cpu_kernel(op):
    assert torch._C._dispatch_has_kernel_for_dispatch_key("ragserve::packed_linear", "CPU")  # the C++ one
    g = torch.Generator().manual_seed(4)
    for bias in (False, True):
        linear = torch.nn.Linear(96, 160, bias=bias)
        layer = PackedLinear(linear)
        x = torch.randn(5, 96, generator=g)
        want = torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")
        torch.testing.assert_close(layer(x), want, rtol=0, atol=0)
        torch.testing.assert_close(layer(x), linear(x), rtol=1e-4, atol=1e-4)
