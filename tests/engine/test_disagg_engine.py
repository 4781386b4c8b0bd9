"""--role prefill / decode over a real cachestore: the decode engine fetches the prompt's full blocks and its tail
block, computes only the last prompt token, and generates what one engine alone generates."""

from __future__ import annotations

import pytest

from ragserve_engine.llm import LLM
from ragserve_engine.sampling_params import SamplingParams
from tests.helpers.cachestore import CacheStoreProcess
from tests.helpers.net import free_port
from tests.helpers.tiny_models import tiny_model

FIRST = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)  # the prefill leg
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def cachestore(tmp_path):
    store = CacheStoreProcess(tmp_path / "cachestore.log", free_port(), "--memory", "256MiB").wait_serving()
    yield store
    store.stop()


def eager(**kwargs) -> LLM:
    return LLM(str(tiny_model("llama")), enforce_eager=True, num_gpu_blocks=128, **kwargs)


@pytest.mark.parametrize("tail", [6, 0, 15])
def test_decode_engine_computes_only_the_last_prompt_token(cachestore, tail):
    prefill = eager(cachestore=cachestore.address, role="prefill")
    model = prefill.engine.runner.model
    decode = eager(cachestore=cachestore.address, role="decode", loaded_model=model)
    prompt = list(range(3000, 3000 + 20 * 16 + tail + 1))  # 20 full blocks, `tail` tokens, the last token
    first = prefill.generate([prompt], FIRST)[0].outputs[0].token_ids
    out = decode.generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == 20 * 16 + tail  # reported as cached: not computed here
    assert decode.engine.connector.stats.hits == 20 * 16 + tail  # the tail was fetched, not computed
    # no prefill work: its one prompt-token step (the last token) counts as a decode step (load_stats.is_decode)
    assert decode.engine.stats().computed_prompt_tokens == 0
    reference = eager(loaded_model=model).generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert out.outputs[0].token_ids == reference
    assert first == reference[:1]


def test_decode_engine_recomputes_without_the_store(cachestore, tmp_path):
    """Store gone between the legs: the decode engine computes the prompt itself, same tokens."""
    prefill = eager(cachestore=cachestore.address, role="prefill")
    prompt = list(range(4000, 4000 + 5 * 16 + 3))
    prefill.generate([prompt], FIRST)
    cachestore.stop()
    decode = eager(cachestore=cachestore.address, role="decode", loaded_model=prefill.engine.runner.model)
    out = decode.generate([prompt], GREEDY)[0]
    assert decode.engine.connector.stats.hits == 0
    reference = eager(loaded_model=prefill.engine.runner.model).generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert out.outputs[0].token_ids == reference


def test_role_needs_a_cachestore():
    with pytest.raises(ValueError, match="needs --cachestore"):
        eager(role="decode")
