"""Compiled decode graphs (whole-model torch.compile of decode-only steps): same greedy tokens as eager,
padding rows never leak, bounded compiles, off with --enforce-eager."""

from __future__ import annotations

import asyncio
import threading
import time

import torch

from ragserve_engine.compilation.decode_graphs import capture_sizes
from ragserve_engine.llm import LLM
from ragserve_engine.llm_engine import LLMEngine
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
    for n in range(1, 10):  # 3, 5, 6, 7 and 9 (8 + 1 waiting) need padding rows
        prompts = _prompts(n, shift=n)
        assert _tokens(graphs, prompts) == _tokens(eager, prompts), n
    assert stats.steps > 0
    assert set(stats.compiled) == {1, 2, 4, 8}
    # one graph per capture size, whatever the width
    assert sorted(graphs.engine.runner.decode_graphs._graphs) == [1, 2, 4, 8]
    # a second pass hits the prefix cache: decode-only steps over cached blocks, same tokens
    prompts = _prompts(6, shift=6)
    steps = stats.steps
    out = graphs.generate(prompts, GREEDY)
    assert sum(o.num_cached_tokens for o in out) > 0 and stats.steps > steps
    assert [o.outputs[0].token_ids for o in out] == _tokens(eager, prompts)
    # another pool size (another kv cache shape) reuses the graphs: the block count is dynamic too
    other = LLM(path, num_gpu_blocks=200, max_num_seqs=8, loaded_model=eager.engine.runner.model)
    assert _tokens(other, prompts[:2]) == _tokens(eager, prompts[:2])
    assert other.engine.runner.decode_graphs.stats.steps > 0
    assert other.engine.runner.decode_graphs.stats.traced == 0  # the first engine's graphs, none traced again


def test_models_share_graphs_only_with_their_own_signature():
    """The graphs keep no guards on the model: a model with another config or other shapes gets its own
    copy of decode_forward, one with the same signature (other weights) shares it and reads its own
    weights. Each matches its eager tokens."""
    models = {
        "llama": tiny_model("llama"),
        "llama seed 1": tiny_model("llama", seed=1),
        "qwen3": tiny_model("qwen3"),
        "llama eps 0.5": tiny_model("llama", rms_norm_eps=0.5),  # only a constant differs (not the KV shape)
    }
    forwards, loaded = {}, {}
    for name, path in models.items():
        eager = LLM(str(path), num_gpu_blocks=32, max_num_seqs=1, enforce_eager=True)
        graphs = LLM(str(path), num_gpu_blocks=32, max_num_seqs=1, loaded_model=eager.engine.runner.model)
        prompts = _prompts(2)
        assert _tokens(graphs, prompts) == _tokens(eager, prompts), name
        assert graphs.engine.runner.decode_graphs.stats.steps > 0
        forwards[name] = graphs.engine.runner.decode_graphs.forward
        loaded[name] = graphs.engine.runner.decode_graphs._graphs[1]
    assert forwards["llama seed 1"] is forwards["llama"]
    assert len({id(f) for f in forwards.values()}) == 3
    assert loaded["llama seed 1"] is loaded["llama"] and len({id(f) for f in loaded.values()}) == 3
    guards = str(loaded["llama"]._artifacts.guard_manager).splitlines()
    on_model = [g for g in guards if "L['model']" in g and "GuardManager" not in g]
    assert len(on_model) < 8, on_model  # not one per parameter and module attribute (a few on dict keys remain)


def test_compiled_decode_with_preemption():
    path = str(tiny_model("llama"))
    eager = LLM(path, num_gpu_blocks=9, enforce_eager=True)
    graphs = LLM(path, num_gpu_blocks=9, loaded_model=eager.engine.runner.model, compile_at_start=False)
    prompts = _prompts(4)  # need 2+2+3+3 blocks at the end: the pool of 9 runs out while decoding
    assert _tokens(graphs, prompts) == _tokens(eager, prompts)
    assert graphs.engine.scheduler.num_preemptions > 0
    assert graphs.engine.runner.decode_graphs.stats.steps > 0


def test_a_graph_step_writes_only_its_sequences_slots():
    path = str(tiny_model("llama"))
    llm = LLM(path, num_gpu_blocks=32, max_num_seqs=8, block_size=16, compile_at_start=False)
    runner = llm.engine.runner
    kv = runner.kv_cache.data
    assert kv.shape[0] == runner.num_blocks  # no block past the scheduler's pool
    llm.generate(_prompts(3), GREEDY)  # decodes at 3 sequences run the size-4 graph: one padding row
    assert 4 in runner.decode_graphs.stats.compiled
    # one more decode step of 3 sequences, straight through the graph: exactly their 3 slots (every layer,
    # K and V) change; the padding row, which reads block 0, writes nothing
    tables = torch.tensor([[5, 6], [7, 8], [9, 10]]).numpy()
    positions = torch.tensor([20, 17, 31]).numpy()
    before = kv.clone()
    with torch.inference_mode():  # as the engine steps
        runner.decode_graphs.run(4, [101, 102, 103], positions, tables)
    changed = (kv != before).flatten(4).any(-1)  # [blocks, layers, 2, block_size]
    where = {(b, off) for b, _, _, off in changed.nonzero().tolist()}
    assert where == {(6, 4), (8, 1), (10, 15)}
    assert changed.sum() == 3 * kv.shape[1] * 2
    # the steps that compiled a graph are not speed samples for the router (LoadTracker)
    assert llm.engine.load.untimed_steps >= len(runner.decode_graphs.stats.compiled) > 0


def test_graphs_compile_past_dynamos_default_recompile_limit_on_an_engine_thread():
    """Nine capture sizes, stepped on a thread as the server's engine is: dynamo's config is thread-local
    and its default recompile limit is 8 graphs a function; one process holds more (sizes x models)."""
    llm = LLM(str(tiny_model("llama")), num_gpu_blocks=256, max_num_seqs=128, max_model_len=64, compile_at_start=False)
    graphs = llm.engine.runner.decode_graphs
    assert len(graphs.sizes) == 9
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            for n in (1, 2, 3, 5, 9, 17, 25, 33, 65):
                llm.generate([[100 + i, 7, 9] for i in range(n)], params)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert not errors
    assert llm.engine.runner.decode_graphs is graphs  # never fell back to eager
    assert sorted(graphs.stats.compiled) == graphs.sizes


def test_a_server_engine_compiles_in_the_background_and_never_waits():
    """AsyncLLM (what the server runs): a size not compiled yet runs eager while a thread compiles it;
    once compiled, the same size runs its graph. Tokens match eager throughout."""
    from ragserve.engine_args import EngineConfig
    from ragserve_engine.async_engine import AsyncLLM

    path = str(tiny_model("llama"))
    eager = LLM(path, num_gpu_blocks=64, max_num_seqs=4, enforce_eager=True)
    config = EngineConfig(model=path, num_gpu_blocks=64, max_num_seqs=4, compile_at_start=False)
    engine = LLMEngine(config, eager.engine.runner.model)
    graphs = engine.runner.decode_graphs
    graphs.sizes = [2]  # one capture size: both prompts decode at it
    release = threading.Event()
    real_call = graphs._call

    def held_call(size, inputs):  # the compile thread waits until the first request is done
        release.wait(120)
        return real_call(size, inputs)

    graphs._call = held_call
    llm = AsyncLLM(EngineConfig(model=path), engine)
    prompts = _prompts(2, shift=11)

    async def gen(prompt: list[int], rid: str) -> list[int]:
        outs = [o async for o in llm.generate(prompt, GREEDY, rid)]
        return outs[-1].outputs[0].token_ids

    async def both(tag: str) -> list[list[int]]:
        return list(await asyncio.gather(*(gen(p, f"{tag}{i}") for i, p in enumerate(prompts))))

    try:
        assert asyncio.run(both("a")) == _tokens(eager, prompts)  # decoded eager: the graph is not ready
        assert graphs.stats.steps == 0 and 2 not in graphs.stats.compile_seconds
        stats = engine.stats()  # what /metrics exports (ragserve:decode_graphs_pending / _compiled)
        assert (stats.decode_graphs_pending, stats.decode_graphs_compiled) == (1, 0)
        beside_compile = engine.load.untimed_steps
        assert beside_compile > 0  # steps beside the in-flight compile are not speed samples
        release.set()
        deadline = time.monotonic() + 300
        while 2 not in graphs.stats.compile_seconds and time.monotonic() < deadline:
            time.sleep(0.2)
        assert graphs.stats.compiled == [2]
        stats = engine.stats()
        assert (stats.decode_graphs_pending, stats.decode_graphs_compiled) == (0, 1)
        assert asyncio.run(both("b")) == _tokens(eager, prompts)
        assert graphs.stats.steps > 0  # now through the graph
        assert engine.load.untimed_steps == beside_compile  # once compiled, every step is a sample again
    finally:
        llm.shutdown()


def test_a_size_whose_background_compile_fails_stays_eager_and_is_not_pending():
    """A compile that raises (here the graph call, injected: no real compile fails on demand) leaves its size
    eager and no longer pending, so nothing waiting for ragserve:decode_graphs_pending == 0 waits forever."""
    path = str(tiny_model("llama"))
    graphs = LLM(path, num_gpu_blocks=64, max_num_seqs=4, compile_at_start=False).engine.runner.decode_graphs

    def broken(size, inputs):
        raise RuntimeError("injected compile failure")

    graphs._call = broken
    graphs.compile_in_background()
    try:
        assert graphs.size_for(2, 8) is None  # queued: runs eager meanwhile
        deadline = time.monotonic() + 60
        while graphs.num_pending and time.monotonic() < deadline:
            time.sleep(0.05)
        assert graphs.num_pending == 0 and graphs.stats.failed == {2}
        assert graphs.size_for(2, 8) is None and 2 not in graphs.stats.compile_seconds  # eager from now on
    finally:
        graphs.stop()
