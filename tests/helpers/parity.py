"""Greedy parity against Hugging Face transformers, with the near-tie rule checked, not assumed."""

from __future__ import annotations

import torch

NEAR_TIE = 1e-3

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


def reference_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def assert_parity(hf_model, prompt: list[int], ours: list[int], ref: list[int], label: str = "") -> bool:
    """Equal, or the first divergence is a genuine near-tie in the reference. Returns exact equality."""
    if ours == ref:
        return True
    k = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), min(len(ours), len(ref)))
    assert k < min(len(ours), len(ref)), f"{label}: lengths differ without a token divergence: {ours} vs {ref}"
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + ref[:k]])).logits[0, -1].float()
    top2 = logits.topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < NEAR_TIE, f"{label}: diverged at step {k} ({ours[k]} vs {ref[k]}) with a top-2 gap of {gap:.2e}"
    return False
