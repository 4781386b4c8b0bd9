"""The blended forward and token selection, on a tiny Llama (GQA, llama3 rope scaling)."""

from __future__ import annotations

import pytest
import torch

from ragserve_engine.blend.forward import blend_forward, deviation, select_rows
from ragserve_engine.blend.runner import Blender
from ragserve_engine.blend.spec import BlendSpec, Selection
from ragserve_engine.llm import LLM
from tests.helpers.tiny_models import tiny_model

BEFORE = [7, 8, 9, 10, 11] * 4
DOC_A = [300 + i for i in range(40)]
DOC_B = [900 + i for i in range(33)]
QUESTION = [21, 22, 23, 24, 25, 26]
PROMPT = BEFORE + DOC_A + [4] + DOC_B + QUESTION
SPANS = [(20, 60), (61, 94)]
KEYS = Selection(sink_tokens=0, filter_layers=1, filter_start=1.0, value_weight=0.0)  # key deviation at one layer


@pytest.fixture(scope="module")
def blender():
    llm = LLM(str(tiny_model("llama")), num_gpu_blocks=64, enforce_eager=True)
    return Blender(llm.engine.runner, b"\1" * 32, 0.15, 1 << 26, selection=KEYS)


def _run(blender, plan):
    kv = {}
    ids = torch.tensor(PROMPT)
    with torch.inference_mode():
        hidden, rows = blend_forward(
            blender.model, ids, torch.arange(len(ids)), plan, lambda i, k, v: kv.setdefault(i, (k, v))
        )
    return hidden, rows, kv


@pytest.mark.parametrize(("check_layer", "selection"), [(0, KEYS), (1, KEYS), (0, Selection(4, 2, 2.0, 1.0))])
def test_fraction_one_is_a_full_prefill(blender, check_layer, selection):
    full_hidden, full_rows, full_kv = _run(blender, None)
    blender.selection = selection
    try:
        plan = blender.plan(PROMPT, BlendSpec(SPANS, 1.0))
    finally:
        blender.selection = KEYS
    plan.check_layer = check_layer  # 0: layer 1 merges fresh rows into the stored K/V
    hidden, rows, kv = _run(blender, plan)
    assert rows.tolist() == full_rows.tolist() == list(range(len(PROMPT)))
    torch.testing.assert_close(hidden, full_hidden)
    for layer, (k, v) in full_kv.items():
        torch.testing.assert_close(kv[layer][0], k)
        torch.testing.assert_close(kv[layer][1], v)


@pytest.mark.parametrize("fraction", [0.0, 0.05, 0.3])
def test_partial_fraction_recomputes_non_chunk_rows_and_the_chosen_few(blender, fraction):
    plan = blender.plan(PROMPT, BlendSpec(SPANS, fraction))
    plan.check_layer = 0  # the tiny model has two layers: select at 0 so layer 1 reuses
    num_chunk = 40 + 33
    assert plan.num_recompute == -(-int(fraction * num_chunk * 1000) // 1000)
    _, rows, kv = _run(blender, plan)
    chunk_rows = [r for r in rows.tolist() if any(a <= r < b for a, b in SPANS)]
    assert len(chunk_rows) == plan.num_recompute
    assert set(range(len(PROMPT))) - {r for a, b in SPANS for r in range(a, b)} <= set(rows.tolist())
    # after the check layer, rows not recomputed carry their stored (re-rotated) K/V
    reused = [r for a, b in SPANS for r in range(a, b) if r not in set(rows.tolist())]
    last = len(kv) - 1
    torch.testing.assert_close(kv[last][0][reused], plan.old_kv[last, 0, reused])
    torch.testing.assert_close(kv[last][1][reused], plan.old_kv[last, 1, reused])
    # at the check layer every row's K/V is fresh
    full = _run(blender, None)[2]
    torch.testing.assert_close(kv[0][0], full[0][0])


def test_select_rows_takes_largest_key_deviation_among_reusable():
    k = torch.zeros(6, 1, 2)
    old = torch.zeros(6, 1, 2)
    old[1, 0, 0], old[3, 0, 0], old[4, 0, 0] = 0.5, 2.0, 1.0
    reusable = torch.tensor([False, True, True, True, True, False])
    dev = deviation(k, k, old, k, 0.0)
    assert select_rows(dev, reusable, 2).tolist() == [0, 3, 4, 5]
    assert select_rows(dev, reusable, 0).tolist() == [0, 5]
    assert select_rows(dev, reusable, 9).tolist() == list(range(6))


def test_value_deviation_counts_when_weighted():
    k, v, old_v = torch.ones(4, 1, 2), torch.ones(4, 1, 2), torch.ones(4, 1, 2)
    old_k = k.clone()
    old_k[1] += 0.1  # row 1: keys moved a little; row 2: values moved a lot
    old_v[2] += 5.0
    reusable = torch.tensor([True, True, True, False])
    assert select_rows(deviation(k, v, old_k, old_v, 0.0), reusable, 1).tolist() == [1, 3]
    assert select_rows(deviation(k, v, old_k, old_v, 1.0), reusable, 1).tolist() == [2, 3]


def test_sink_tokens_are_recomputed_within_the_budget(blender):
    blender.selection = Selection(sink_tokens=4)
    try:
        plan = blender.plan(PROMPT, BlendSpec(SPANS, 0.3))
    finally:
        blender.selection = KEYS
    plan.check_layer = 0
    sinks = [r for a, _ in SPANS for r in range(a, a + 4)]
    assert not plan.reusable[sinks].any() and int(plan.reusable.sum()) == 73 - 8
    assert plan.num_recompute == -(-73 * 3 // 10) - 8  # the fraction's budget includes the sinks
    _, rows, _ = _run(blender, plan)
    chunk_rows = [r for r in rows.tolist() if any(a <= r < b for a, b in SPANS)]
    assert set(sinks) <= set(chunk_rows) and len(chunk_rows) == -(-73 * 3 // 10)


def test_gradual_filtering_narrows_to_the_final_count(blender):
    plan = blender.plan(PROMPT, BlendSpec(SPANS, 0.1))
    plan.check_layer, plan.filter_layers, plan.filter_start = 0, 2, 3.0
    assert [plan.keep_at(i) for i in range(3)] == [3 * plan.num_recompute, plan.num_recompute, None]
    seen = []
    with torch.inference_mode():
        _, rows = blend_forward(blender.model, torch.tensor(PROMPT), torch.arange(len(PROMPT)), plan,
                                lambda i, k, v: seen.append(len(k)))  # fmt: skip
    chunk_rows = [r for r in rows.tolist() if any(a <= r < b for a, b in SPANS)]
    assert len(chunk_rows) == plan.num_recompute and seen == [len(PROMPT)] * 2


def test_chunks_are_computed_once_and_looked_up_by_content(blender):
    before = len(blender.store)
    blender.plan(PROMPT, BlendSpec(SPANS, 0.1))
    hits = blender.store.stats.hits
    blender.plan([1] + DOC_B + [2, 3] + DOC_A + [5], BlendSpec([(1, 34), (36, 76)], 0.1))  # reordered
    assert len(blender.store) <= before + 2
    assert blender.store.stats.hits == hits + 2
