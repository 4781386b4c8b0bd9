"""--role prefill / decode over a real cachestore: the decode engine fetches the prompt's full blocks and its tail
block; given the prefill engine's first token it computes no prompt token, without it only the last one, and either
way it generates what one engine alone generates. The prefill engine's
answer waits for the store to take the prompt's blocks; its other requests keep stepping meanwhile."""

from __future__ import annotations

import asyncio

import pytest

from ragserve_engine.async_engine import AsyncLLM
from ragserve_engine.kv_tail import prompt_tail
from ragserve_engine.llm import LLM
from ragserve_engine.sampling_params import SamplingParams
from tests.helpers.cachestore import CacheStoreProcess
from tests.helpers.net import free_port
from tests.helpers.process import frozen, until_async
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


def generate(llm: LLM, prompt: list[int], params: SamplingParams, **kw):
    """One request through the engine, with make_request's keyword options (first_token_id)."""
    llm.engine.add_request("one", prompt, params, **kw)
    while llm.engine.has_unfinished_requests():
        done = [out for out in llm.engine.step() if out.finished]
    return done[0]


@pytest.mark.parametrize("tail", [6, 0, 15])  # 15: the prompt ends on a block boundary (its last block is full)
def test_decode_engine_given_the_first_token_computes_no_prompt_token(cachestore, tail):
    prefill = eager(cachestore=cachestore.address, role="prefill")
    model = prefill.engine.runner.model
    decode = eager(cachestore=cachestore.address, role="decode", loaded_model=model)
    prompt = list(range(3000, 3000 + 20 * 16 + tail + 1))
    first = prefill.generate([prompt], FIRST)[0].outputs[0].token_ids
    out = generate(decode, prompt, GREEDY, first_token_id=first[0])
    assert out.num_cached_tokens == len(prompt)  # every prompt token's KV came from the prefill engine
    assert decode.engine.connector.stats.hits == len(prompt)
    assert decode.engine.stats().computed_prompt_tokens == 0
    reference = eager(loaded_model=model).generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert out.outputs[0].token_ids == reference  # the first token is output, and counted in max_tokens
    assert len(reference) == GREEDY.max_tokens


def test_seeded_sampling_continues_after_the_first_token(cachestore):
    """The decode engine's seeded generator starts where the prefill engine's left off (one draw a token)."""
    prefill = eager(cachestore=cachestore.address, role="prefill")
    model = prefill.engine.runner.model
    decode = eager(cachestore=cachestore.address, role="decode", loaded_model=model)
    prompt = list(range(6000, 6000 + 4 * 16 + 9))
    seeded = dict(temperature=1.0, seed=11, ignore_eos=True)
    first = prefill.generate([prompt], SamplingParams(max_tokens=1, **seeded))[0].outputs[0].token_ids
    out = generate(decode, prompt, SamplingParams(max_tokens=10, **seeded), first_token_id=first[0])
    reference = eager(loaded_model=model).generate([prompt], SamplingParams(max_tokens=10, **seeded))[0]
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids
    assert out.num_cached_tokens == len(prompt)


def test_the_first_token_is_output_before_the_fetch(cachestore):
    """The given first token is the request's first output at once: a client sees it while the decode engine still
    waits for the prompt's KV (the store frozen), not after the fetch and the first step."""
    prefill = eager(cachestore=cachestore.address, role="prefill")
    model = prefill.engine.runner.model
    decode = eager(cachestore=cachestore.address, role="decode", loaded_model=model)
    prompt = list(range(7000, 7000 + 12 * 16 + 5))
    first = prefill.generate([prompt], FIRST)[0].outputs[0].token_ids[0]
    reference = eager(loaded_model=model).generate([prompt], GREEDY)[0].outputs[0].token_ids
    asyncio.run(_first_output_while_frozen(AsyncLLM(decode.engine.config, decode.engine), cachestore, prompt, first,
                                           reference))  # fmt: skip


async def _first_output_while_frozen(llm: AsyncLLM, store, prompt: list[int], first: int, reference: list[int]):
    try:
        with frozen([store.process]):
            outputs = llm.generate(prompt, GREEDY, "given", first_token_id=first)
            out = await asyncio.wait_for(anext(outputs), 30)
            assert out.outputs[0].token_ids == [first] and not out.finished
            assert out.outputs[0].text == llm.engine.tokenizer.decode([first], True)
            assert llm.engine.stats().computed_prompt_tokens == 0 and not llm.engine.scheduler.running
        last = [o async for o in outputs][-1]
        assert last.finished and last.outputs[0].token_ids == reference
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("params", "kw", "message"),
    [
        (SamplingParams(n=2, temperature=0.0), {}, "n=1"),
        (SamplingParams(logprobs=2), {}, "logprobs"),
        (SamplingParams(max_tokens=1), {}, "at least 2"),
        (GREEDY, {"resume_token_ids": [5]}, "cannot be combined"),
    ],
)
def test_first_token_id_refused_where_it_cannot_continue(params, kw, message):
    llm = eager()
    with pytest.raises(ValueError, match=message):
        llm.engine.make_request("r", [1, 2, 3], params, first_token_id=7, **kw)
    with pytest.raises(ValueError, match="first_token_id token ids must be integers"):
        llm.engine.make_request("r", [1, 2, 3], GREEDY, first_token_id=10**9)


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


def test_prefill_answer_waits_for_the_store_not_the_steps(cachestore):
    """The store frozen (SIGSTOP) while a prompt completes on the prefill engine: a request decoding beside it keeps
    getting tokens while the prompt's answer waits; thawed, the answer leaves, every block of the prompt (its tail
    block included) in the store."""
    prefill = eager(cachestore=cachestore.address, role="prefill")
    asyncio.run(_answer_waits_for_the_store(AsyncLLM(prefill.engine.config, prefill.engine), cachestore))


async def _answer_waits_for_the_store(llm: AsyncLLM, store: CacheStoreProcess) -> None:
    engine, decoded = llm.engine, asyncio.Queue()
    prompt = list(range(5000, 5000 + 20 * 16 + 6 + 1))  # 20 full blocks, a 6-token tail, the last token

    async def decode() -> None:
        params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
        async for out in llm.generate(list(range(100, 120)), params, "decoding"):
            decoded.put_nowait(out)

    async def leg() -> list:
        return [out async for out in llm.generate(prompt, FIRST, "leg")]

    decoding = asyncio.create_task(decode())
    try:
        await asyncio.wait_for(decoded.get(), 60)
        stored = engine.connector.stats.transfer_requests["stored"]  # the decoding request's prompt's
        with frozen([store.process]):
            answer = asyncio.create_task(leg())
            await until_async(lambda: "leg" in engine.saving.marks, timeout=60, interval=0.005, what="leg computed")
            while not decoded.empty():
                decoded.get_nowait()
            for _ in range(3):  # steps go on while the store has the leg's blocks in flight
                await asyncio.wait_for(decoded.get(), 60)
            assert not answer.done() and "leg" in engine.saving.marks  # its answer waits for the store
        outputs = await asyncio.wait_for(answer, 60)
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 1
        connector = engine.connector
        hashes = engine.kv_manager.hash_blocks(prompt, None)
        tail = prompt_tail(engine.kv_manager, engine.make_request("probe", prompt, FIRST).seqs[0], None)
        assert tail is not None and tail[0] == 7  # the 6 tokens and the last one
        assert connector.client.lookup([*hashes, tail[1]]) == len(hashes) + 1  # all stored, tail included
        assert connector.stats.transfer_requests["stored"] == stored + 1
        assert not decoding.done()  # still decoding: nothing held it
    finally:
        decoding.cancel()
        await asyncio.gather(decoding, return_exceptions=True)
        llm.shutdown()
