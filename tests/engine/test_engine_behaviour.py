"""Engine behaviour on a tiny model: leaks, forks sharing blocks, seeded sampling, bad input."""

from __future__ import annotations

import random

import pytest

from ragserve_engine.llm import LLM
from ragserve_engine.sampling_params import SamplingParams
from tests.helpers.tiny_models import tiny_model


# Eager: what these tests check is scheduling and block accounting; offline, a compiled engine compiles each
# decode batch size inline the first time it runs (the random workload below meets most of them: ~70 s of a cold
# run). The compiled path has its own tests (test_decode_graphs, test_tiny_model_parity's base pass).
@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(tiny_model("llama")), num_gpu_blocks=256, enforce_eager=True)


def fresh(llm: LLM, **kwargs) -> LLM:
    return LLM(str(tiny_model("llama")), loaded_model=llm.engine.runner.model, enforce_eager=True, **kwargs)


def assert_pool_consistent(engine) -> None:
    pool = engine.pool
    assert pool.num_free_blocks == pool.num_blocks, "blocks leaked"
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert len(list(pool.free_queue)) == pool.num_blocks
    for h, block in pool.cached.items():
        assert block.block_hash == h
    assert sum(1 for b in pool.blocks if b.block_hash is not None) == len(pool.cached)
    assert not engine.requests and not engine.scheduler.has_work()
    assert len(engine.kv_manager.swap.free) == engine.kv_manager.swap.num_blocks


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_no_leaks_under_random_aborts_and_preemption(llm, mode):
    engine = fresh(llm, num_gpu_blocks=16, max_num_seqs=8, max_num_batched_tokens=64, preemption_mode=mode,
                   swap_space=0.01).engine  # fmt: skip
    rng = random.Random(7)
    shared = [rng.randrange(100, 40000) for _ in range(40)]
    ids = 0
    for _ in range(80):
        for _ in range(rng.randrange(0, 6)):
            prompt = shared[: rng.randrange(0, 40)] + [rng.randrange(100, 40000) for _ in range(rng.randrange(1, 30))]
            kind = rng.random()
            params = SamplingParams(
                max_tokens=rng.randrange(1, 30), temperature=rng.choice([0.0, 0.8]), ignore_eos=True,
                n=2 if kind < 0.2 else 1, use_beam_search=0.2 <= kind < 0.3, beam_width=2,
            )  # fmt: skip
            if params.use_beam_search:
                params.temperature = 0.0
            engine.add_request(f"r{ids}", prompt, params)
            ids += 1
        engine.step()
        for rid in list(engine.requests):
            if rng.random() < 0.04:
                engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    assert ids >= 150 and engine.scheduler.num_preemptions > 0
    assert_pool_consistent(engine)


def test_parallel_sampling_shares_prompt_blocks(llm):
    prompt = list(range(1000, 1100))  # 100 tokens: 6 full blocks + a partial one
    params = SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    shared = fresh(llm, num_gpu_blocks=128).engine
    shared.add_request("n4", prompt, params)
    peak_shared = _peak_blocks(shared)
    solo = fresh(llm, num_gpu_blocks=128, enable_prefix_caching=False).engine
    for i in range(4):
        solo.add_request(f"solo{i}", prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=i, ignore_eos=True))
    peak_solo = _peak_blocks(solo)
    assert peak_solo == 4 * 7
    assert peak_shared == 6 + 4  # the full prompt blocks once, then one copied partial block per sample
    outs = LLM.generate(fresh(llm, num_gpu_blocks=128), [prompt], params)[0].outputs
    assert len(outs) == 4 and len({tuple(o.token_ids) for o in outs}) > 1


def test_beam_search_shares_blocks_and_finds_a_better_sequence(llm):
    prompt = list(range(2000, 2040))
    eng = fresh(llm, num_gpu_blocks=128)
    beam = eng.generate([prompt], SamplingParams(use_beam_search=True, beam_width=4, n=2, max_tokens=5,
                                                  temperature=0.0, ignore_eos=True))[0]  # fmt: skip
    greedy = eng.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0].outputs[0]
    assert len(beam.outputs) == 2
    assert beam.outputs[0].cumulative_logprob >= beam.outputs[1].cumulative_logprob
    assert beam.outputs[0].cumulative_logprob >= greedy.cumulative_logprob - 1e-4
    engine = fresh(llm, num_gpu_blocks=128).engine
    engine.add_request("b", prompt, SamplingParams(use_beam_search=True, beam_width=4, max_tokens=5, temperature=0.0,
                                                  ignore_eos=True))  # fmt: skip
    assert _peak_blocks(engine) < 4 * 3  # 4 independent beams would hold 3 blocks each
    assert_pool_consistent(engine)


def test_beam_search_matches_transformers_num_beams(llm):
    """The same beams, in the same order, with the same scores as transformers' beam search on the same weights
    (fixed length: EOS ignored here, masked there by min_new_tokens; length_penalty 0 scores the plain sum)."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = list(range(2000, 2040))
    params = SamplingParams(use_beam_search=True, beam_width=4, n=4, max_tokens=6, temperature=0.0, ignore_eos=True)
    ours = fresh(llm, num_gpu_blocks=128).generate([prompt], params)[0].outputs
    ref = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32).eval()
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([prompt]), num_beams=4, num_return_sequences=4, max_new_tokens=6, min_new_tokens=6,
            do_sample=False, length_penalty=0.0, return_dict_in_generate=True, output_scores=True,
            pad_token_id=0,
        )  # fmt: skip
    expected = [seq[len(prompt) :].tolist() for seq in out.sequences]
    assert [list(o.token_ids) for o in ours] == expected
    assert [o.cumulative_logprob for o in ours] == pytest.approx(out.sequences_scores.tolist(), abs=1e-3)


def _peak_blocks(engine) -> int:
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.pool.num_blocks - engine.pool.num_free_blocks)
    return peak


def test_seeded_sampling_is_independent_of_batch_mates(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=10, ignore_eos=True)
    target = list(range(500, 530))
    alone = fresh(llm, num_gpu_blocks=128).generate([target], params)[0].outputs[0].token_ids
    mates = [list(range(700, 700 + k)) for k in (3, 50, 17)]
    batch = fresh(llm, num_gpu_blocks=128).generate(
        [mates[0], target, mates[1], mates[2]],
        [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True), params,
         SamplingParams(temperature=0.7, seed=9, max_tokens=4), SamplingParams(temperature=0.0, max_tokens=8)],
    )  # fmt: skip
    assert batch[1].outputs[0].token_ids == alone
    other_seed = fresh(llm, num_gpu_blocks=128).generate([target], SamplingParams(**{**vars(params), "seed": 99}))
    assert other_seed[0].outputs[0].token_ids != alone


def test_stop_strings_stop_tokens_min_tokens_and_logprobs(llm):
    prompt = list(range(300, 320))
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    stop_tok = free.token_ids[3]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop_tok]))[0]
    assert out.outputs[0].token_ids == free.token_ids[: free.token_ids.index(stop_tok) + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_tok
    half = len(free.text) // 2  # a stop string from the second half, without whitespace (always checked)
    mid = next(free.text[i : i + 3] for i in range(half, len(free.text) - 2) if not free.text[i : i + 3].isspace())
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, stop=[mid]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == free.text[: free.text.index(mid)]
    blocked = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6,
                                                    stop_token_ids=[free.token_ids[0]]))[0].outputs[0]  # fmt: skip
    assert blocked.token_ids[0] != free.token_ids[0] and len(blocked.token_ids) == 6
    lp = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3, logprobs=3, prompt_logprobs=2))[0]
    first = lp.outputs[0].logprobs[0]
    assert lp.outputs[0].token_ids[0] in first and len(first) >= 3
    assert max(first.values()) == first[lp.outputs[0].token_ids[0]]  # greedy takes the top logprob
    assert len(lp.prompt_logprobs) == len(prompt) and lp.prompt_logprobs[0] is None


def test_swap_preemption_swaps_out_and_back_in(llm):
    """With room on the host every preemption is a swap-out that is swapped back in; outputs unchanged."""
    prompts, params = [list(range(100 + 40 * i, 140 + 40 * i)) for i in range(4)], SWAP_PARAMS
    expected = [o.outputs[0].token_ids for o in fresh(llm, num_gpu_blocks=64).generate(prompts, params)]
    roomy = fresh(llm, num_gpu_blocks=6, preemption_mode="swap", swap_space=0.01)
    assert [o.outputs[0].token_ids for o in roomy.generate(prompts, params)] == expected
    swap = roomy.engine.kv_manager.swap
    assert roomy.engine.scheduler.num_preemptions == swap.num_swap_outs > 0
    assert swap.num_swap_ins == swap.num_swap_outs and swap.num_fallbacks == 0
    assert roomy.engine.stats().num_swap_fallbacks == 0


def test_swap_falls_back_to_recompute_when_the_host_is_full(llm):
    """Two host slots hold no 3-block group: each preemption recomputes, counted as a swap fallback."""
    prompts, params = [list(range(100 + 40 * i, 140 + 40 * i)) for i in range(4)], SWAP_PARAMS
    expected = [o.outputs[0].token_ids for o in fresh(llm, num_gpu_blocks=64).generate(prompts, params)]
    two_slots = 2 * llm.engine.runner.bytes_per_block / (1 << 30)
    tight = fresh(llm, num_gpu_blocks=6, preemption_mode="swap", swap_space=two_slots)
    assert tight.engine.kv_manager.swap.num_blocks == 2
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, params)] == expected
    swap = tight.engine.kv_manager.swap
    assert swap.num_swap_outs == swap.num_swap_ins == 0
    assert tight.engine.scheduler.num_preemptions == swap.num_fallbacks > 0
    assert tight.engine.stats().num_swap_fallbacks == swap.num_fallbacks


SWAP_PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "prompt must not be empty"),
        ("", SamplingParams(), "prompt must not be empty"),
        (list(range(5000)), SamplingParams(), "max_model_len"),
        ([1, 2, 3], SamplingParams(max_tokens=5000), "exceeds max_model_len"),
        ([1, 10**9], SamplingParams(), "token ids must be integers"),
    ],
)
def test_bad_input_is_a_clear_error_and_engine_keeps_serving(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request("bad", prompt, params)
    assert not llm.engine.requests
    assert llm.generate(["still serving"], SamplingParams(max_tokens=2))[0].finished


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -1.0), ("top_p", 0.0), ("top_k", -5), ("min_p", 2.0), ("max_tokens", 0), ("n", 0),
     ("logprobs", 50), ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("stop", [""])],
)  # fmt: skip
def test_invalid_sampling_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"invalid sampling parameter {field}="):
        SamplingParams(**{field: value})


def test_kv_cache_too_small_for_request_is_rejected(llm):
    small = fresh(llm, num_gpu_blocks=4)
    with pytest.raises(ValueError, match="KV blocks"):
        small.engine.add_request("big", list(range(100)), SamplingParams(max_tokens=10))
