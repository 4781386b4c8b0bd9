"""Every sampling parameter changes what is sampled the way it should, checked against the reference
next-token distribution from Hugging Face transformers (tiny llama: a nearly flat distribution, so a
filter that is not applied lets samples land far outside the set it keeps)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from ragserve_engine.llm import LLM
from ragserve_engine.sampler import Sampler, SamplingRow, inverse_transform
from ragserve_engine.sampling_params import SamplingParams
from tests.helpers.tiny_models import tiny_model

PROMPT = list(range(300, 320))
N = 300  # seeded one-token samples per distribution


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(
        str(tiny_model("llama")), num_gpu_blocks=256, enforce_eager=True
    )  # sampling, not compile, is what varies


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model("llama")), dtype=torch.float32).eval()


def ref_logits(hf, tokens: list[int]) -> torch.Tensor:
    """The reference next-token logits after every position of `tokens` (float64)."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].double()


@pytest.fixture(scope="module")
def probs(hf) -> torch.Tensor:
    return ref_logits(hf, PROMPT)[-1].softmax(-1)


def first_tokens(llm: LLM, **params) -> list[int]:
    batch = [SamplingParams(max_tokens=1, seed=i, **params) for i in range(N)]
    return [o.outputs[0].token_ids[0] for o in llm.generate([PROMPT] * N, batch)]


def top_set(probs: torch.Tensor, k: int) -> set[int]:
    return set(probs.topk(k).indices.tolist())


def nucleus(probs: torch.Tensor, top_p: float) -> set[int]:
    """The smallest most-likely set whose mass reaches top_p."""
    sorted_p, order = probs.sort(descending=True)
    before = sorted_p.cumsum(0) - sorted_p
    return set(order[before < top_p].tolist())


@pytest.fixture(scope="module")
def unfiltered(llm) -> list[int]:
    return first_tokens(llm, temperature=1.0)


def test_unfiltered_samples_spread_over_the_vocabulary(unfiltered, probs):
    """The baseline that makes the filter tests below meaningful: without a filter, samples leave every set."""
    assert len(set(unfiltered)) > N * 0.9
    assert not set(unfiltered) <= top_set(probs, 50)
    assert not set(unfiltered) <= nucleus(probs, 0.05 + 2e-3)


def test_inverse_transform_samples_the_distribution_and_never_a_zero_probability_token():
    """Each token's share of 40,000 draws is its probability (within 4 standard errors); masked tokens never come,
    not even at u -> 1 where u x total rounds up to the total."""
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.25, 0.05, 0.0], dtype=torch.float64)
    gen, draws = torch.Generator().manual_seed(11), 40_000
    counts = Counter(inverse_transform(probs, torch.rand(1, dtype=torch.float64, generator=gen)) for _ in range(draws))
    for token, p in enumerate(probs.tolist()):
        assert abs(counts[token] / draws - p) <= 4 * (p * (1 - p) / draws) ** 0.5, (token, counts)
    top = torch.tensor([1.0 - 2**-53], dtype=torch.float64)
    assert inverse_transform(probs, top) == 5 and inverse_transform(probs, torch.zeros(1, dtype=torch.float64)) == 1


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    for seed in range(3):
        params = SamplingParams(temperature=1.5, top_k=1, seed=seed, max_tokens=8, ignore_eos=True)
        assert llm.generate([PROMPT], params)[0].outputs[0].token_ids == greedy.outputs[0].token_ids


def test_top_k_samples_only_the_k_most_likely(llm, probs):
    got = Counter(first_tokens(llm, temperature=1.0, top_k=5))
    assert set(got) == top_set(probs, 5)  # all five, nothing else


@pytest.mark.parametrize("temperature", [1.0, 0.05])
def test_temperature_reshapes_the_distribution(llm, probs, temperature):
    """Among the top 5 the sampled frequencies follow softmax(logits / T): flat at 1.0, peaked at 0.05."""
    top = probs.topk(5).indices
    expected = (probs[top].log() / temperature).softmax(-1)
    got = Counter(first_tokens(llm, temperature=temperature, top_k=5))
    freq = torch.tensor([got[int(t)] / N for t in top], dtype=torch.float64)
    tolerance = 4 * (expected * (1 - expected) / N).sqrt() + 0.01
    assert bool(((freq - expected).abs() <= tolerance).all()), (freq.tolist(), expected.tolist())


def test_top_p_samples_only_the_nucleus(llm, probs):
    got = set(first_tokens(llm, temperature=1.0, top_p=0.05))
    assert got <= nucleus(probs, 0.05 + 2e-3)  # slack for float32 vs float64 at the boundary
    assert len(got) > 50  # and it does sample within it


def test_min_p_drops_tokens_below_the_threshold(llm, probs):
    got = set(first_tokens(llm, temperature=1.0, min_p=0.6))
    kept = set((probs >= (0.6 - 0.01) * probs.max()).nonzero().flatten().tolist())
    assert got <= kept and len(got) >= 3, (got, kept)


def penalized_argmax(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> int:
    """The OpenAI/vLLM definitions, token by token: repetition over prompt and output, presence and
    frequency over the output so far."""
    logits = logits.clone()
    counts = Counter(output)
    for token in set(prompt) | set(output):
        if p.repetition_penalty != 1.0:
            x = logits[token]
            logits[token] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        if counts[token]:
            logits[token] -= p.frequency_penalty * counts[token] + p.presence_penalty
    return int(logits.argmax())


PENALTIES = [
    dict(presence_penalty=-2.0),
    dict(frequency_penalty=-1.0),
    dict(repetition_penalty=0.5),
    dict(presence_penalty=-2.0, frequency_penalty=1.0),
    dict(presence_penalty=-2.0, repetition_penalty=3.0),
]


@pytest.mark.parametrize("penalties", PENALTIES, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_penalties_pick_the_penalized_argmax_at_every_step(llm, hf, penalties):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, **penalties)
    plain = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    ours = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    assert ours != plain.outputs[0].token_ids  # the penalty matters here
    logits = ref_logits(hf, PROMPT + ours[:-1])[len(PROMPT) - 1 :]
    for step, token in enumerate(ours):
        want = penalized_argmax(logits[step], PROMPT, ours[:step], params)
        assert token == want, f"step {step}: {token} vs {want}"


def test_penalties_change_the_counts_they_should(llm):
    def counts(**penalties) -> Counter:
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **penalties)
        return Counter(llm.generate([PROMPT], params)[0].outputs[0].token_ids)

    assert max(counts().values()) == 1  # greedy on this model never repeats
    loop = max(counts(presence_penalty=-2.0).values())
    assert loop >= 4  # a negative presence penalty rewards tokens already generated
    assert max(counts(frequency_penalty=-1.0).values()) >= 4
    assert max(counts(presence_penalty=-2.0, frequency_penalty=1.0).values()) < loop  # each repeat costs more
    assert max(counts(presence_penalty=-2.0, frequency_penalty=2.0).values()) <= 2  # net penalty from the 2nd
    from_prompt = sum(counts(repetition_penalty=0.5)[t] for t in set(PROMPT))
    assert from_prompt > 0 and sum(counts()[t] for t in set(PROMPT)) == 0  # < 1 rewards prompt tokens


def test_one_sampler_call_matches_each_row_sampled_alone():
    """Batched rows (one argmax for the greedy ones, logsumexp logprobs, log-softmax only where asked)
    give what each row gives alone, and the reference log-softmax logprob of the chosen token."""
    logits = torch.randn(6, 64, generator=torch.Generator().manual_seed(0)) * 3
    greedy = SamplingParams(temperature=0.0)

    def rows() -> list[SamplingRow]:
        params = [greedy, SamplingParams(temperature=0.0, logprobs=3), greedy, SamplingParams(temperature=0.0,
                  repetition_penalty=2.0), SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=0.0,
                  logprobs=0)]  # fmt: skip
        blocked = [[], [], [int(logits[2].argmax())], [], [], []]
        gens = [torch.Generator().manual_seed(7) if p.seed is not None else None for p in params]
        return [SamplingRow(p, [1, 2], [3], g, b) for p, g, b in zip(params, gens, blocked, strict=True)]

    together = Sampler()(logits.clone(), rows())
    alone = [Sampler()(logits[i : i + 1].clone(), [row])[0] for i, row in enumerate(rows())]
    reference = torch.log_softmax(logits.double(), -1)
    for i, (got, want) in enumerate(zip(together, alone, strict=True)):
        assert got.token_id == want.token_id and got.top_logprobs == want.top_logprobs, i
        assert got.logprob == pytest.approx(float(reference[i, got.token_id]), abs=1e-5), i
    assert [r.token_id for r in together][:2] == logits[:2].argmax(-1).tolist()
    assert together[2].token_id != int(logits[2].argmax())  # blocked
    assert [r.top_logprobs is None for r in together] == [True, False, True, True, True, False]
    assert len(together[1].top_logprobs) >= 3 and set(together[5].top_logprobs) == {together[5].token_id}


def test_a_mixed_batch_samples_each_request_as_alone(llm):
    """In one engine step greedy rows share a call, the others sample per request: same tokens, logprobs
    and (within float error) cumulative logprobs as each request run alone; n=2 forks share a logits row."""
    batch = [
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.9, seed=3, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, presence_penalty=-2.0),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=2),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0),
    ]
    prompts = [PROMPT[i:] for i in range(len(batch) - 1)] + [PROMPT]
    together = llm.generate(prompts, batch)
    for prompt, params, got in zip(prompts, batch, together, strict=True):
        want = llm.generate([prompt], params)[0]
        for a, b in zip(got.outputs, want.outputs, strict=True):  # logits differ in float error batched or alone
            assert a.token_ids == b.token_ids
            assert [list(x) for x in a.logprobs or []] == [list(x) for x in b.logprobs or []]
            assert [pytest.approx(x, abs=1e-4) for x in a.logprobs or []] == (b.logprobs or [])
            assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-4)
    chosen = [lp[t] for lp, t in zip(together[5].outputs[0].logprobs, together[5].outputs[0].token_ids, strict=True)]
    assert together[0].outputs[0].token_ids == together[5].outputs[0].token_ids  # same prompt
    assert together[0].outputs[0].cumulative_logprob == pytest.approx(sum(chosen), abs=1e-4)  # logsumexp path
