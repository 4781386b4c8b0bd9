"""AsyncLLM: concurrent streams, abort on early exit, errors raised to the caller, KV events."""

from __future__ import annotations

import asyncio

import pytest

from ragserve.engine_args import EngineConfig
from ragserve.keys import block_hashes
from ragserve_engine.async_engine import AsyncLLM
from ragserve_engine.sampling_params import SamplingParams
from tests.helpers.tiny_models import tiny_model


@pytest.fixture(scope="module")
def engine():
    # eager: compiled == eager has its own tests (test_decode_graphs.py); here what matters is the async layer
    llm = AsyncLLM(EngineConfig(model=str(tiny_model("llama")), num_gpu_blocks=64, enforce_eager=True))
    yield llm
    llm.shutdown()


async def collect(engine: AsyncLLM, rid: str, prompt, params: SamplingParams):
    outs = [o async for o in engine.generate(prompt, params, rid)]
    return outs


def test_concurrent_streams_match_offline_greedy(engine):
    from ragserve_engine.llm import LLM

    prompts = [list(range(100 + i, 140 + 7 * i)) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    async def main():
        return await asyncio.gather(*(collect(engine, f"c{i}", p, params) for i, p in enumerate(prompts)))

    results = asyncio.run(main())
    for outs in results:
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 6
        tokens = [len(o.outputs[0].token_ids) for o in outs]
        assert tokens == sorted(tokens) and len(outs) >= 2  # streamed token by token
    model = engine.engine.runner.model
    offline = LLM(str(tiny_model("llama")), num_gpu_blocks=64, loaded_model=model, enforce_eager=True)
    expected = [o.outputs[0].token_ids for o in offline.generate(prompts, params)]
    assert [outs[-1].outputs[0].token_ids for outs in results] == expected


def test_early_exit_aborts_and_frees_blocks(engine):
    async def main():
        gen = engine.generate(list(range(10, 90)), SamplingParams(max_tokens=200, ignore_eos=True), "leave")
        async for out in gen:
            if len(out.outputs[0].token_ids) >= 2:
                break
        await gen.aclose()
        for _ in range(100):
            await asyncio.sleep(0.05)
            if engine.stats().free_blocks == engine.stats().total_blocks and not engine.engine.requests:
                return True
        return False

    assert asyncio.run(main())


def test_bad_request_raises_in_caller_and_engine_keeps_serving(engine):
    async def main():
        with pytest.raises(ValueError, match="prompt must not be empty"):
            await collect(engine, "bad", [], SamplingParams())
        return await collect(engine, "good", [5, 6, 7], SamplingParams(max_tokens=2))

    assert asyncio.run(main())[-1].finished


def test_kv_events_reach_listeners(engine):
    seen = []
    engine.add_kv_event_listener(seen.extend)

    async def main():
        await collect(engine, "ev", prompt, SamplingParams(max_tokens=1))

    prompt = list(range(3000, 3040))  # two full blocks
    asyncio.run(main())
    stored = [h for e in seen if e.kind == "stored" for h in e.block_hashes]
    assert stored == block_hashes(prompt, 16, engine.engine.kv_manager.root)[:2]
    assert set(stored) <= set(engine.engine.pool.cached)  # announced blocks are the ones the cache holds


def test_requests_submitted_while_steps_are_held_start_together(engine):
    """steps_held (start-up calibration's batch): requests arriving apart are taken but not stepped until the
    block ends, then prefilled in one step, so each gets its first token from the same step."""
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    async def main():
        async with engine.steps_held():
            first = asyncio.create_task(collect(engine, "held-0", list(range(200, 240)), params))
            await asyncio.sleep(0.3)  # unheld, the step thread would have finished this request by now
            second = asyncio.create_task(collect(engine, "held-1", list(range(300, 340)), params))
            while await engine.num_requests() < 2:
                await asyncio.sleep(0.01)
            assert not first.done() and engine.stats().num_running == 0
        return await asyncio.gather(first, second)

    results = asyncio.run(main())
    assert all(outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3 for outs in results)
    firsts = [outs[0].metrics.first_token_time for outs in results]
    assert firsts[0] == firsts[1]


def test_a_long_text_prompt_is_tokenized_off_the_event_loop(engine, monkeypatch):
    """Over OFFLOAD_CHARS a text prompt is tokenized on a worker thread (encode releases the GIL, so the loop
    serves on), with the same result as the ids given directly; a short one stays on the loop."""
    import threading

    from ragserve.tokenizer import OFFLOAD_CHARS

    threads: list[threading.Thread] = []
    make_request = engine.engine.make_request

    def recorded(*args, **kw):
        threads.append(threading.current_thread())
        return make_request(*args, **kw)

    monkeypatch.setattr(engine.engine, "make_request", recorded)
    long_text = "cluster " * (OFFLOAD_CHARS // 8 + 10)
    ids = engine.engine.tokenizer.encode(long_text)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    async def main():
        loop_thread = threading.current_thread()
        from_text = await collect(engine, "long-text", long_text, params)
        from_ids = await collect(engine, "long-ids", ids, params)
        short = await collect(engine, "short-text", "cluster " * 4, params)
        return loop_thread, from_text, from_ids, short

    loop_thread, from_text, from_ids, short = asyncio.run(main())
    assert len(threads) == 3 and threads[0] is not loop_thread and threads[1] is threads[2] is loop_thread
    assert from_text[-1].prompt_token_ids == ids
    assert from_text[-1].outputs[0].token_ids == from_ids[-1].outputs[0].token_ids
    assert short[-1].finished
