"""Compiled decode graphs (whole-model torch.compile of decode-only steps): same greedy tokens as eager,
padding rows never leak, bounded compiles, off with --enforce-eager."""

from __future__ import annotations

import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from ragserve_engine.compilation.decode_graphs import capture_sizes, decode_forward
from ragserve_engine.llm import LLM
from ragserve_engine.sampling_params import SamplingParams
from tests.helpers.tiny_models import tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompts(n: int, shift: int = 0) -> list[list[int]]:
    # lengths 5..37: contexts cross 16-token block boundaries while decoding
    return [[(i * 7919 + j * 104729 + shift) % 40000 + 100 for j in range(5 + 4 * i)] for i in range(n)]


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def test_capture_sizes():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 64]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_compiled_decode_matches_eager_and_compiles_once_per_size():
    path = str(tiny_model("llama"))
    eager = LLM(path, num_gpu_blocks=128, max_num_seqs=8, enforce_eager=True)
    assert eager.engine.runner.decode_graphs is None  # --enforce-eager: no graphs
    graphs = LLM(path, num_gpu_blocks=128, max_num_seqs=8, loaded_model=eager.engine.runner.model)
    stats = graphs.engine.runner.decode_graphs.stats
    before = len(_debug_get_cache_entry_list(decode_forward))  # dynamo's compiled graphs of the function
    for n in range(1, 10):  # 3, 5, 6, 7 and 9 (8 + 1 waiting) need padding rows
        prompts = _prompts(n, shift=n)
        assert _tokens(graphs, prompts) == _tokens(eager, prompts), n
    assert stats.steps > 0
    assert set(stats.compiled) == {1, 2, 4, 8}
    # one graph per capture size, whatever the width
    assert len(_debug_get_cache_entry_list(decode_forward)) - before <= 4
    # a second pass hits the prefix cache: decode-only steps over cached blocks, same tokens
    prompts = _prompts(6, shift=6)
    steps = stats.steps
    out = graphs.generate(prompts, GREEDY)
    assert sum(o.num_cached_tokens for o in out) > 0 and stats.steps > steps
    assert [o.outputs[0].token_ids for o in out] == _tokens(eager, prompts)


def test_compiled_decode_with_preemption():
    path = str(tiny_model("llama"))
    eager = LLM(path, num_gpu_blocks=9, enforce_eager=True)
    graphs = LLM(path, num_gpu_blocks=9, loaded_model=eager.engine.runner.model)
    prompts = _prompts(4)  # need 2+2+3+3 blocks at the end: the pool of 9 runs out while decoding
    assert _tokens(graphs, prompts) == _tokens(eager, prompts)
    assert graphs.engine.scheduler.num_preemptions > 0
    assert graphs.engine.runner.decode_graphs.stats.steps > 0


def test_padding_rows_write_only_the_scratch_block():
    path = str(tiny_model("llama"))
    llm = LLM(path, num_gpu_blocks=32, max_num_seqs=8)
    runner = llm.engine.runner
    kv = runner.kv.data
    assert kv.shape[0] == runner.num_blocks + 1  # the scratch block the scheduler never sees
    llm.generate(_prompts(3), GREEDY)  # decodes at 3 sequences run the size-4 graph: one padding row
    assert 4 in runner.decode_graphs.stats.compiled
    assert torch.count_nonzero(kv[runner.num_blocks]) > 0
