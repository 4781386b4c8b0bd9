"""bench/engine.py's baselines and limits: this machine's measured fp32 GEMM peak and memory bandwidth,
the model's roofline, Hugging Face transformers and llama.cpp (llama-cpp-python) on the same weights."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ragserve.model_source import ModelSource


@dataclass
class Machine:
    gemm_flops: float  # fp32 square GEMM, FLOP/s
    read_bytes: float  # streaming read bandwidth, bytes/s


def measure_machine(n: int = 2048, mib: int = 512, repeats: int = 5) -> Machine:
    """Best of `repeats`: an n x n fp32 matmul, and a sum over `mib` MiB of fp32 (one read of every byte)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    big = torch.ones(mib * (1 << 20) // 4)
    gemm = read = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        a @ b
        t1 = time.perf_counter()
        big.sum()
        t2 = time.perf_counter()
        gemm, read = min(gemm, t1 - t0), min(read, t2 - t1)
    return Machine(2 * n**3 / gemm, big.numel() * 4 / read)


@dataclass
class Roofline:
    """Lower bounds on step time from the weights read and the FLOPs done."""

    weight_bytes: float  # every projection and the LM head, read once per step
    flops_per_token: float  # 2 x those weights' parameters
    cfg: object

    @classmethod
    def of(cls, model: torch.nn.Module, bytes_per_param: float = 4.0) -> Roofline:
        cfg = model.config
        params = cfg.num_layers * sum(
            m.in_features * m.out_features for m in model.layers[0].modules() if hasattr(m, "in_features")
        ) + cfg.hidden_size * cfg.vocab_size  # fmt: skip
        return cls(params * bytes_per_param, 2.0 * params, cfg)

    def attention_flops(self, q_len: int, ctx: int) -> float:
        c = self.cfg
        return 4.0 * c.num_layers * c.num_heads * c.head_dim * q_len * (ctx - (q_len - 1) / 2)

    def decode_tok_s(self, m: Machine, batch: int, ctx: int) -> float:
        """Best decode tokens/s at `batch` sequences of `ctx` context: max(weight reads, FLOPs) per step."""
        flops = batch * (self.flops_per_token + self.attention_flops(1, ctx))
        return batch / max(self.weight_bytes / m.read_bytes, flops / m.gemm_flops)

    def prefill_s(self, m: Machine, tokens: int) -> float:
        return (tokens * self.flops_per_token + self.attention_flops(tokens, tokens)) / m.gemm_flops


def load_hf(source: ModelSource):
    from transformers import AutoModelForCausalLM

    load = dict(gguf_file=source.path.name) if source.kind == "gguf" else {}
    path = str(source.path.parent if source.kind == "gguf" else source.path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **load).eval()


class FirstTokenClock:
    """A transformers streamer that only notes when the first new token arrived (generate's first put() is the
    prompt, the second the first token of every sequence of the batch)."""

    def __init__(self) -> None:
        self.puts, self.start, self.first = 0, time.perf_counter(), 0.0  # first: seconds after start

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter() - self.start

    def end(self) -> None:
        pass


@torch.inference_mode()
def hf_generate(hf, prompts: list[list[int]], new_tokens: int, clock: FirstTokenClock | None = None):
    """One left-padded batch run to exactly new_tokens: (seconds, tokens computed incl. padding). With a clock,
    clock.first is the seconds until the first token arrived (decode-only time: the rest)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    if clock is not None:
        clock.start = t0
    hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                pad_token_id=0, streamer=clock)  # fmt: skip
    return time.perf_counter() - t0, len(prompts) * (width + new_tokens)


@torch.inference_mode()
def hf_prefill(hf, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    hf(torch.tensor([prompt]), logits_to_keep=1)
    return time.perf_counter() - t0


def hf_bucketed(hf, prompts: list[list[int]], outputs: list[int], batch_size: int) -> tuple[float, int]:
    """Requests sorted by prompt length, batches of batch_size, each run to its longest output:
    (seconds, tokens HF computed: padding and overrun included, the baseline's most generous credit)."""
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), outputs[i]))
    wall, computed = 0.0, 0
    for i in range(0, len(order), batch_size):
        idx = order[i : i + batch_size]
        t, n = hf_generate(hf, [prompts[j] for j in idx], max(outputs[j] for j in idx))
        wall, computed = wall + t, computed + n
    return wall, computed


class LlamaCpp:
    """llama.cpp on the GGUF file itself (its own quantized weights), one sequence, greedy."""

    def __init__(self, path: str, threads: int, n_ctx: int = 4096) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=2048,
                         verbose=False)  # fmt: skip

    def prefill(self, prompt: list[int]) -> float:
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(prompt)
        return time.perf_counter() - t0

    def generate(self, prompt: list[int], new_tokens: int) -> tuple[float, float]:
        """Prefill, then new_tokens greedy tokens (the first from the prefill's logits): (seconds, seconds until
        the first token)."""
        self.llm.reset()
        t0 = time.perf_counter()
        first = 0.0
        for n, _ in enumerate(self.llm.generate(prompt, top_k=1, temp=0.0, reset=True), start=1):
            if n == 1:
                first = time.perf_counter() - t0
            if n == new_tokens:
                break
        return time.perf_counter() - t0, first
