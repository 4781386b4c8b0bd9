"""Chunk KV through a real cachestore: an engine blends with chunks another engine computed."""

from __future__ import annotations

import pytest

from ragserve_engine.blend.spec import BlendSpec
from ragserve_engine.llm import LLM
from tests.engine.test_blend_engine import rag_prompt, run
from tests.helpers.cachestore import CacheStoreProcess
from tests.helpers.net import free_port
from tests.helpers.tiny_models import tiny_model


@pytest.fixture
def address(tmp_path):
    store = CacheStoreProcess(tmp_path / "cachestore.log", free_port(), "--memory", "256MiB").wait_serving()
    yield store.address
    store.stop()


def test_second_engine_takes_chunks_from_the_cachestore(address):
    a = LLM(str(tiny_model("llama")), num_gpu_blocks=128, cachestore=address)
    prompt, spans = rag_prompt([0, 1, 2])
    run(a, [(prompt, BlendSpec(spans, 0.15))])
    a.engine.blender.remote.flush()
    assert a.engine.blender.remote.stats.stored > 0

    b = LLM(str(tiny_model("llama")), num_gpu_blocks=128, cachestore=address, loaded_model=a.engine.runner.model)
    reordered, spans2 = rag_prompt([2, 0, 1])
    (got,) = run(b, [(reordered, BlendSpec(spans2, 0.15))])
    assert b.engine.blender.remote.stats.hits == 3 and b.engine.blender.store.stats.misses == 3  # none computed
    (expected,) = run(a, [(reordered, BlendSpec(spans2, 0.15))])  # A blends from its own store
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert got.num_blend_reused_tokens == expected.num_blend_reused_tokens > 0


def test_unreachable_cachestore_falls_back_to_computing(tmp_path):
    llm = LLM(str(tiny_model("llama")), num_gpu_blocks=128, cachestore=f"127.0.0.1:{free_port()}")
    prompt, spans = rag_prompt([1, 2])
    (out,) = run(llm, [(prompt, BlendSpec(spans, 0.15))])
    assert len(out.outputs[0].token_ids) == 12 and out.num_blend_reused_tokens > 0
    assert llm.engine.blender.remote.stats.misses == 2
