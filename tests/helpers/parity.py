"""Greedy parity against Hugging Face transformers, with the near-tie rule checked, not assumed.

The rule (as in vLLM's and SGLang's parity checks): where our greedy token differs from the reference's,
our token's *reference* logit must be within NEAR_TIE of the reference's top logit (a genuine tie that
float rounding may break either way); the rest of that output is then not compared. At most
MAX_EXCUSED such divergences per model and test: more means a real numerical difference.
"""

from __future__ import annotations

import torch

NEAR_TIE = 1e-3
MAX_EXCUSED = 1

TEXTS = [
    "Hi",
    "The capital of France is",
    "Retrieval-augmented generation retrieves documents and puts them in the prompt, so the model can",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "PagedAttention splits the KV cache into fixed-size blocks, like pages of virtual memory. " * 3,
    "Q: What is 17 + 25?\nA:",
    "Once upon a time, in a data center far away, a GPU ran out of memory because",
    "Context: ragserve stores each document's KV cache once per cluster and reuses it.\n" * 6 + "Question: why?",
]

_EN = [
    "The {name} bridge over the {river} river opened in {year}; its main span is {n} metres long.",
    "In {year} the city council of {city} voted to rebuild the {name} library after a fire destroyed {n} books.",
    "Engineers measured {n} vehicles a day crossing the {name} bridge, twice the number planned in {year}.",
    "The {river} river floods {city} roughly every {k} years; the worst flood, in {year}, reached {n} cm.",
]
_ZH = [
    "{city}的{name}大桥于{year}年建成，主跨长{n}米，横跨{river}河。",
    "{year}年，{city}市议会决定重建{name}图书馆，此前一场大火烧毁了{n}本书。",
    "工程师统计，每天有{n}辆车通过{name}大桥，是{year}年规划数量的两倍。",
    "{river}河大约每{k}年淹没{city}一次，{year}年的洪水最严重，水位达到{n}厘米。",
]
_NAMES = {
    "en": (["North", "Harbour", "Stone", "Queen", "Iron"], ["Avon", "Dee", "Tay", "Wye"], ["Kingsport", "Elmford"]),
    "zh": (["北门", "海港", "石桥", "长青", "铁塔"], ["清", "漓", "湘", "沅"], ["江宁", "临安"]),
}
INSTRUCTIONS = {"en": "Answer the question from the retrieved passages.", "zh": "请根据检索到的资料回答问题。"}
QUESTIONS = {
    "en": "Using only the passages above, how long is the main span of the North bridge, and when did it open?",
    "zh": "只根据上面的资料回答：北门大桥的主跨有多长？它是哪一年建成的？",
}


def rag_messages(lang: str, tokenizer, target_tokens: int = 2000) -> list[dict]:
    """A RAG chat: numbered retrieved passages (about target_tokens tokens in all), then a question."""
    templates, (names, rivers, cities) = (_EN if lang == "en" else _ZH), _NAMES[lang]
    passages: list[str] = []
    i = 0
    while len(tokenizer.encode("\n\n".join(passages))) < target_tokens:
        sentences = [
            templates[(i + j) % len(templates)].format(
                name=names[(i + j) % len(names)],
                river=rivers[(i * 3 + j) % len(rivers)],
                city=cities[(i + j) % len(cities)],
                year=1850 + (i * 37 + j * 11) % 170,
                n=100 + (i * 97 + j * 31) % 900,
                k=2 + (i + j) % 9,
            )  # fmt: skip
            for j in range(4)
        ]
        passages.append(f"[{i + 1}] " + ("" if lang == "zh" else " ").join(sentences))
        i += 1
    system = INSTRUCTIONS[lang] + "\n\n" + "\n\n".join(passages)
    return [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[lang]}]


def reference_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def assert_parity(hf_model, prompt: list[int], ours: list[int], ref: list[int], label: str = "") -> bool:
    """Equal (True), or the first divergence is excused by the near-tie rule (False); else fails."""
    if ours == ref:
        return True
    k = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), min(len(ours), len(ref)))
    assert k < min(len(ours), len(ref)), f"{label}: lengths differ without a token divergence: {ours} vs {ref}"
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + ref[:k]])).logits[0, -1].float()
    behind = float(logits.max() - logits[ours[k]])
    assert behind <= NEAR_TIE, (
        f"{label}: diverged at step {k}: our token {ours[k]}'s reference logit is {behind:.2e} below the top "
        f"({ref[k]}); a near-tie needs <= {NEAR_TIE}"
    )
    return False


def assert_all_parity(hf_model, prompts, ours, refs, label: str = "") -> None:
    """assert_parity for each prompt, and at most MAX_EXCUSED excused divergences among them."""
    exact = [
        assert_parity(hf_model, p, o, r, f"{label} prompt {i}")
        for i, (p, o, r) in enumerate(zip(prompts, ours, refs, strict=True))
    ]
    excused = [i for i, ok in enumerate(exact) if not ok]
    assert len(excused) <= MAX_EXCUSED, (
        f"{label}: {len(excused)} near-tie divergences (prompts {excused}); at most {MAX_EXCUSED}"
    )
