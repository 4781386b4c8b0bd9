"""Chunk keys as KV events (the router's exact index learns where chunks live), and a blended prefill that
raises failing its request alone."""

from __future__ import annotations

import pytest
import torch

from ragserve.keys import chunk_key
from ragserve_engine.blend.spec import BlendSpec
from ragserve_engine.llm import LLM
from ragserve_engine.sampling_params import SamplingParams
from tests.engine.test_blend_engine import DOCS, rag_prompt, run
from tests.helpers.tiny_models import tiny_model


@pytest.fixture
def llm():
    llm = LLM(str(tiny_model("llama")), num_gpu_blocks=256, enforce_eager=True)
    llm.engine.pool.record_events = True  # as the server does when it publishes events
    return llm


def key(llm: LLM, doc: int) -> bytes:
    return chunk_key(llm.engine.blender.root, DOCS[doc])


def chunk_events(llm: LLM) -> list[tuple[str, bytes]]:
    keys = {key(llm, d) for d in range(len(DOCS))}
    return [(e.kind, h) for e in llm.engine.pool.take_events() for h in e.block_hashes if h in keys]


def test_stored_and_evicted_chunks_are_published_and_in_snapshots(llm):
    store = llm.engine.blender.store
    prompt, spans = rag_prompt([0, 1])
    run(llm, [(prompt, BlendSpec(spans, 0.15))])
    assert chunk_events(llm) == [("stored", key(llm, 0)), ("stored", key(llm, 1))]
    run(llm, [(prompt, BlendSpec(spans, 0.15))])
    assert chunk_events(llm) == []  # reused, not stored again
    store.capacity = store.used  # room for two documents' KV only: the next one evicts the oldest
    prompt, spans = rag_prompt([2])
    run(llm, [(prompt, BlendSpec(spans, 0.15))])
    events = chunk_events(llm)
    assert ("removed", key(llm, 0)) in events and events[-1] == ("stored", key(llm, 2))
    held = set(store.entries)
    snapshot = set(llm.engine.pool.snapshot().block_hashes)
    assert held <= snapshot and key(llm, 0) not in snapshot
    assert llm.engine.pool.reset_prefix_cache()
    events = llm.engine.pool.take_events()
    assert events[0].kind == "cleared" and {h for e in events[1:] for h in e.block_hashes} == held


def test_a_failing_blended_prefill_fails_only_its_request(llm):
    good, good_spans = rag_prompt([0, 1])
    bad, bad_spans = rag_prompt([2, 1])
    plain = [40 + i for i in range(70)]
    expected = [o.outputs[0].token_ids for o in run(llm, [(good, BlendSpec(good_spans, 0.15)), (plain, None)])]
    llm.engine.blender.store.put(key(llm, 2), torch.zeros(3))  # a corrupt entry: blending [2, 1] raises
    engine, params = llm.engine, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("good", good, params, blend=BlendSpec(good_spans, 0.15))
    engine.add_request("bad", bad, params, blend=BlendSpec(bad_spans, 0.15))
    engine.add_request("plain", plain, params)
    done, failed = {}, {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
        failed |= engine.take_failed()
    assert set(failed) == {"bad"} and isinstance(failed["bad"], IndexError | RuntimeError)
    assert [done["good"], done["plain"]] == expected
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    del engine.blender.store.entries[key(llm, 2)]  # the engine carries on: the same prompt now blends
    (again,) = run(llm, [(bad, BlendSpec(bad_spans, 0.15))])
    assert len(again.outputs[0].token_ids) == 12
