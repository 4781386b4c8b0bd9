"""Triton kernels (under TRITON_INTERPRET=1 on CPU) against the torch reference backend.

Every batch mixes decode, prefill over a cached prefix and a fresh prefill in one launch.
"""

from __future__ import annotations

import pytest
import torch

from ragserve_engine.attention.paged_batch import lazy_kv_cache, make_paged_batch
from ragserve_engine.attention.torch_ref import TorchAttentionBackend
from tests.helpers.triton_interpret import interpreted_import

with interpreted_import():  # the kernels run on CPU, interpreted
    from ragserve_engine.attention.triton_backend import TritonAttentionBackend

pytestmark = pytest.mark.usefixtures("triton_interpret")

MIXED = [(1, 37), (5, 18), (17, 129)]  # (query length, context length): decode, cached-prefix prefill, prefill
FRESH = [(1, 37), (5, 18), (17, 17)]  # the last sequence is a prefill with nothing cached
REF = TorchAttentionBackend()


def run_both(batch, backend: TritonAttentionBackend) -> tuple[torch.Tensor, torch.Tensor, object, object]:
    """Write + attend with the reference and with Triton, each on its own copy of the cache."""
    ref_kv, tri_kv = batch.clone_kv(), batch.clone_kv()
    outs = []
    for impl, kv in ((REF, ref_kv), (backend, tri_kv)):
        cache = batch.cache(kv)
        impl.write_kv(batch.key, batch.value, cache, batch.meta.slot_mapping)
        scale = batch.query.shape[-1] ** -0.5
        outs.append(impl.forward(batch.query, batch.key, batch.value, cache, batch.meta, scale))
    return outs[0], outs[1], ref_kv, tri_kv


def assert_close(ref: torch.Tensor, out: torch.Tensor, n: int, atol: float = 2e-5) -> None:
    err = (ref[:n].float() - out[:n].float()).abs().max().item()
    assert err <= atol, f"max abs error {err:.3g} > {atol}"


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("gqa", [1, 3, 4])
def test_mixed_batch_matches_reference(gqa, block_size):
    batch = make_paged_batch(MIXED, num_heads=2 * gqa, num_kv_heads=2, head_dim=32, block_size=block_size)
    ref, out, ref_kv, tri_kv = run_both(batch, TritonAttentionBackend())
    assert torch.equal(ref_kv.data, tri_kv.data)
    assert_close(ref, out, batch.num_real_tokens)


@pytest.mark.parametrize("head_dim", [16, 64, 128, 48])
def test_head_dims(head_dim):
    """The tiny test models' 16/32, SmolLM2's 64, Llama's 128, and a non power of two (padded in-kernel)."""
    batch = make_paged_batch(FRESH, num_heads=4, num_kv_heads=1, head_dim=head_dim, block_size=16)  # MQA
    ref, out, _, _ = run_both(batch, TritonAttentionBackend())
    assert_close(ref, out, batch.num_real_tokens)


@pytest.mark.parametrize("tile_n", [16, 32, 64])
def test_tiles_spanning_several_blocks(tile_n):
    """KV tiles smaller than, equal to and larger than a block (block size 8 and 32)."""
    for block_size in (8, 32):
        batch = make_paged_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=16, block_size=block_size)
        ref, out, _, _ = run_both(batch, TritonAttentionBackend(tile_n=tile_n))
        assert_close(ref, out, batch.num_real_tokens)


def test_padded_slots_are_skipped():
    batch = make_paged_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, pad_tokens=5)
    before = batch.kv_cache.data.clone()
    ref, out, ref_kv, tri_kv = run_both(batch, TritonAttentionBackend())
    assert torch.equal(ref_kv.data, tri_kv.data)
    # exactly the real tokens' K and V landed: one [2, kv_heads, head_dim] slot each
    changed = (tri_kv.data != before).any(dim=(-1, -2)).any(dim=2).sum().item()  # over K/V, heads, dims
    assert changed == batch.num_real_tokens
    assert_close(ref, out, batch.num_real_tokens)


def test_padding_in_the_middle_of_the_slot_mapping():
    batch = make_paged_batch([(9, 9)], num_heads=2, num_kv_heads=2, head_dim=16, block_size=16)
    slots = batch.meta.slot_mapping.clone()
    slots[[2, 5]] = -1
    kv = batch.clone_kv()
    TritonAttentionBackend().write_kv(batch.key, batch.value, batch.cache(kv), slots)
    written = batch.clone_kv()
    REF.write_kv(batch.key, batch.value, batch.cache(written), slots)
    assert torch.equal(kv.data, written.data)
    block = batch.meta.block_tables[0, 0].item()
    assert kv.data[block, 0, :, 2].abs().sum() == 0 and kv.data[block, 0, :, 3].abs().sum() > 0


@pytest.mark.parametrize("num_splits", [None, 1, 2, 8])
def test_split_kv_decode(num_splits):
    """Flash-decoding: long contexts, few sequences; splits with no tiles (short sequences) are merged away."""
    cases = [(1, 700), (1, 37), (1, 5)]
    batch = make_paged_batch(cases, num_heads=8, num_kv_heads=2, head_dim=32, block_size=16)
    backend = TritonAttentionBackend(num_splits=num_splits)
    if num_splits is None:  # the heuristic splits this decode-only batch
        assert backend._splits(batch.meta, 2, 32, torch.device("cpu")) > 1
    ref, out, _, _ = run_both(batch, backend)
    assert_close(ref, out, batch.num_real_tokens)


def test_split_kv_heuristic_leaves_prefill_and_busy_batches_alone():
    backend = TritonAttentionBackend()
    prefill = make_paged_batch([(1, 700), (3, 9)], num_heads=2, num_kv_heads=1, head_dim=16, block_size=16)
    assert backend._splits(prefill.meta, 1, 32, torch.device("cpu")) == 1
    many = make_paged_batch([(1, 300)] * 20, num_heads=2, num_kv_heads=1, head_dim=16, block_size=16)
    assert backend._splits(many.meta, 1, 32, torch.device("cpu")) == 1


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
def test_block_ids_above_30000(kv_dtype):
    """Block id * block stride passes 2**31 elements: 32-bit offsets would wrap (or fault)."""
    num_layers, block_size, kv_heads, head_dim = 16, 16, 2, 64
    first, num_blocks = 32_770, 32_800
    shape = (num_blocks, num_layers, 2, block_size, kv_heads, head_dim)
    kv = lazy_kv_cache(kv_dtype, torch.float16, shape)
    layer = num_layers - 1
    assert first * kv.data.stride(0) + layer * kv.data.stride(1) > 2**31
    batch = make_paged_batch(
        [(1, 40), (6, 20)], num_heads=4, num_kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
        kv_dtype=kv_dtype, dtype=torch.float16, first_block=first, num_blocks=num_blocks, kv_cache=kv, layer=layer,
    )  # fmt: skip
    used = batch.meta.block_tables[batch.meta.block_tables > 0]
    assert used.numel() == 5 and int(used.min()) >= first
    ref_kv = batch.kv_cache  # the reference writes in place; the Triton run gets the same lazily committed storage
    before = ref_kv.data[batch.meta.block_tables.flatten().long(), layer].clone()
    outs = []
    for impl in (REF, TritonAttentionBackend()):
        ref_kv.data[batch.meta.block_tables.flatten().long(), layer] = before
        cache = batch.cache()
        impl.write_kv(batch.key, batch.value, cache, batch.meta.slot_mapping)
        written = ref_kv.data[batch.meta.block_tables.flatten().long(), layer].clone()
        outs.append((impl.forward(batch.query, batch.key, batch.value, cache, batch.meta, 0.125), written))
    (ref, ref_written), (out, tri_written) = outs
    assert torch.equal(ref_written.view(torch.uint8), tri_written.view(torch.uint8))
    assert_close(ref, out, batch.num_real_tokens, atol=2e-3)  # float16 queries


def test_bfloat16_queries():
    batch = make_paged_batch(MIXED, num_heads=6, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.bfloat16)
    ref, out, ref_kv, tri_kv = run_both(batch, TritonAttentionBackend())
    assert torch.equal(ref_kv.data, tri_kv.data)
    assert_close(ref, out, batch.num_real_tokens, atol=2e-2)  # bf16 rounding of P and the output


def test_backend_options_are_validated():
    with pytest.raises(ValueError, match="power of two"):
        TritonAttentionBackend(num_splits=3)
    with pytest.raises(ValueError, match="tile_n"):
        TritonAttentionBackend(tile_n=8)
