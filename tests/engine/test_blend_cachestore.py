"""Chunk KV through a real cachestore: an engine blends with chunks another engine computed."""

from __future__ import annotations

import pytest

from ragserve_engine.blend.spec import BlendSpec
from ragserve_engine.llm import LLM
from tests.engine.test_blend_engine import num_kept, rag_prompt, run
from tests.helpers.cachestore import CacheStoreProcess
from tests.helpers.net import free_port
from tests.helpers.tiny_models import tiny_model


@pytest.fixture(scope="module")
def address(tmp_path_factory):
    log = tmp_path_factory.mktemp("cachestore") / "cachestore.log"
    store = CacheStoreProcess(log, free_port(), "--memory", "256MiB").wait_serving()
    yield store.address
    store.stop()


def engine(cachestore: str, loaded_model=None) -> LLM:
    return LLM(str(tiny_model("llama")), loaded_model, num_gpu_blocks=128, cachestore=cachestore, enforce_eager=True)


def test_second_engine_takes_chunks_from_the_cachestore(address):
    a = engine(address)
    prompt, spans = rag_prompt([0, 1, 2])
    (cold,) = run(a, [(prompt, BlendSpec(spans, 0.15))])
    assert cold.blend_usage.reused_tokens == 0  # neither store held them: computed, not reused
    assert cold.blend_usage.computed_chunk_tokens == num_kept(spans, 0.15)
    a.engine.blender.remote.flush()
    assert a.engine.blender.remote.stats.stored > 0

    b = engine(address, a.engine.runner.model)
    reordered, spans2 = rag_prompt([2, 0, 1])
    (got,) = run(b, [(reordered, BlendSpec(spans2, 0.15))])
    assert b.engine.blender.remote.stats.hits == 3 and b.engine.blender.store.stats.misses == 3  # none computed
    (expected,) = run(a, [(reordered, BlendSpec(spans2, 0.15))])  # A blends from its own store
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert got.blend_usage == expected.blend_usage  # fetched KV existed before the request: reused
    assert got.blend_usage.reused_tokens == num_kept(spans2, 0.15) and got.blend_usage.computed_chunk_tokens == 0


def test_unreachable_cachestore_falls_back_to_computing():
    llm = engine(f"127.0.0.1:{free_port()}")
    prompt, spans = rag_prompt([1, 2])
    (out,) = run(llm, [(prompt, BlendSpec(spans, 0.15))])
    assert len(out.outputs[0].token_ids) == 12
    assert out.blend_usage.reused_tokens == 0 and out.blend_usage.computed_chunk_tokens == num_kept(spans, 0.15)
    assert llm.engine.blender.remote.stats.misses == 2
