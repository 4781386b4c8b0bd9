"""Engine configuration: one dataclass, filled from CLI flags (vLLM's names) or RAGSERVE_* env vars.

Torch-free, so `ragserve --help` and the chart/operator tests can parse engine flags cheaply.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from ragserve.config import add_flag, fraction, parse_bytes, positive_int
from ragserve.model_source import DEFAULT_MODEL

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    served_model_name: str | None = None
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    num_gpu_blocks: int | None = None  # overrides the memory budget
    kv_cache_memory: int | None = None  # bytes
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    attention_backend: str = "auto"
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    swap_space: float = 1.0  # GiB of host memory for swapped-out blocks
    scheduling_policy: str = "fcfs"
    cachestore: str | None = None  # HOST:PORT[,HOST:PORT]: shared KV-block store (flags live with the server)
    cachestore_tls_ca: str | None = None
    cachestore_tls_cert: str | None = None
    cachestore_tls_key: str | None = None
    cachestore_token_file: str | None = None

    def __post_init__(self) -> None:
        checks = [
            (
                self.block_size in (8, 16, 32, 64, 128),
                f"block_size must be 8, 16, 32, 64 or 128, got {self.block_size}",
            ),
            (self.kv_cache_dtype in KV_CACHE_DTYPES, f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}"),
            (self.attention_backend in ATTENTION_BACKENDS, f"attention_backend must be one of {ATTENTION_BACKENDS}"),
            (self.preemption_mode in PREEMPTION_MODES, f"preemption_mode must be one of {PREEMPTION_MODES}"),
            (self.scheduling_policy in SCHEDULING_POLICIES, f"scheduling_policy must be one of {SCHEDULING_POLICIES}"),
            (self.max_num_seqs > 0, "max_num_seqs must be positive"),
            (self.max_num_batched_tokens > 0, "max_num_batched_tokens must be positive"),
            (self.swap_space >= 0, "swap_space must be >= 0"),
            (0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization must be in (0, 1]"),
            (self.num_gpu_blocks is None or self.num_gpu_blocks > 1, "num_gpu_blocks must be > 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by `ragserve engine` and `ragserve generate`."""
    g = parser.add_argument_group("model")
    add_flag(g, "--model", default=DEFAULT_MODEL, help="alias, HF directory or .gguf file")
    add_flag(g, "--served-model-name", default=None, help="name clients use (default: the model name)")
    add_flag(g, "--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"), help="model dtype")
    add_flag(g, "--device", default="auto", help="cpu, cuda, cuda:N or auto")
    add_flag(g, "--seed", type=int, default=0, help="global seed")
    g = parser.add_argument_group("KV cache")
    add_flag(g, "--block-size", type=positive_int, default=16, help="tokens per KV block")
    add_flag(g, "--num-gpu-blocks", type=positive_int, default=None, help="KV blocks (overrides memory budget)")
    add_flag(g, "--kv-cache-memory", type=parse_bytes, default=None, help="KV cache bytes, e.g. 2GiB")
    add_flag(g, "--gpu-memory-utilization", type=fraction, default=0.9, help="fraction of GPU memory to use")
    add_flag(g, "--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help="KV cache storage dtype")
    add_flag(g, "--attention-backend", default="auto", choices=ATTENTION_BACKENDS, help="attention kernels")
    add_flag(
        g,
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse cached prefix blocks",
    )
    g = parser.add_argument_group("scheduler")
    add_flag(g, "--max-model-len", type=positive_int, default=None, help="max prompt + output tokens")
    add_flag(g, "--max-num-seqs", type=positive_int, default=64, help="max running sequences")
    add_flag(g, "--max-num-batched-tokens", type=positive_int, default=2048, help="token budget per step")
    add_flag(
        g,
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split long prefills across steps",
    )
    add_flag(g, "--preemption-mode", default="recompute", choices=PREEMPTION_MODES, help="when KV blocks run out")
    add_flag(g, "--swap-space", type=float, default=1.0, help="GiB of host memory for swap preemption")
    add_flag(g, "--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES, help="queue order")
