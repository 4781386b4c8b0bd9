"""ModelRunner: owns the model and the paged KV cache; turns a SchedulerOutput into logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragserve.engine_args import EngineConfig
from ragserve.model_source import ModelSource
from ragserve_engine.attention.backend import AttentionMetadata
from ragserve_engine.attention.kv_cache import KVCacheTensors, allocate_kv_cache, bytes_per_block
from ragserve_engine.attention.selector import get_attention_backend
from ragserve_engine.layers.attention import ForwardContext
from ragserve_engine.models.llama import LlamaForCausalLM
from ragserve_engine.models.loader import load_model
from ragserve_engine.scheduler import SchedulerOutput

CPU_DEFAULT_KV_BYTES = 1 << 30
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [num sampled seqs, vocab], in scheduled order
    prompt_logits: dict[int, tuple[int, torch.Tensor]]  # seq_id -> (first position, logits of the chunk)


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, model: LlamaForCausalLM | None = None) -> None:
        """`model` reuses already loaded weights (tests and benchmarks run several engines on one model)."""
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        self.model = model or load_model(source, self.dtype, self.device)
        self.model_config = self.model.config
        self.backend = get_attention_backend(config.attention_backend, self.device, config.kv_cache_dtype)
        self.block_size = config.block_size
        self.bytes_per_block = bytes_per_block(config.kv_cache_dtype, self.dtype, self._block_shape(1))
        self.num_blocks = self._num_blocks()
        self.kv = allocate_kv_cache(config.kv_cache_dtype, self.dtype, self._block_shape(self.num_blocks), self.device)
        self.kv_cache = self.kv.data
        self.kv_layers = self.kv.layers()
        self.num_swap_blocks = int(config.swap_space * (1 << 30)) // self.bytes_per_block
        self.host_cache: KVCacheTensors | None = None  # allocated on first swap-out

    def _block_shape(self, n: int) -> tuple[int, ...]:
        c = self.model_config
        return (n, c.num_layers, 2, self.block_size, c.num_kv_heads, c.head_dim)

    def _num_blocks(self) -> int:
        if self.config.num_gpu_blocks:
            return self.config.num_gpu_blocks
        budget = self.config.kv_cache_memory
        if budget is None and self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(free - total * (1 - self.config.gpu_memory_utilization))
        budget = budget if budget is not None else CPU_DEFAULT_KV_BYTES
        num = budget // self.bytes_per_block
        if num < 2:
            raise ValueError(f"KV cache budget {budget} bytes holds {num} blocks of {self.bytes_per_block} bytes")
        return num

    def copy_blocks(self, out: SchedulerOutput) -> None:
        """Swap out, swap in, then copy-on-write, in that order, before the forward pass."""
        if out.swap_out:
            if self.host_cache is None:
                self.host_cache = self.kv.host_copy(self.num_swap_blocks, pin=self.device.type == "cuda")
            dev, host = map(list, zip(*out.swap_out, strict=True))
            self.host_cache.copy_from(self.kv, dev, host)
        if out.swap_in:
            host, dev = map(list, zip(*out.swap_in, strict=True))
            self.kv.copy_from(self.host_cache, host, dev)
        if out.copies:
            src, dst = map(list, zip(*out.copies, strict=True))
            self.kv.copy_from(self.kv, src, dst)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelOutput:
        self.copy_blocks(out)
        input_ids, positions, meta, sample_idx, prompt_spans = self._prepare(out)
        ctx = ForwardContext(meta, self.backend, self.kv_layers)
        hidden = self.model(input_ids, positions, ctx)
        logits = self.model.compute_logits(hidden[sample_idx])
        prompt_logits = {
            seq_id: (start, self.model.compute_logits(hidden[lo:hi]))
            for seq_id, (start, lo, hi) in prompt_spans.items()
        }
        return ModelOutput(logits, prompt_logits)

    def _prepare(self, out: SchedulerOutput):
        bs = self.block_size
        ids, pos, slots, q_starts, seq_lens, sample_idx, prompt_spans = [], [], [], [0], [], [], {}
        for s in out.scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            table = seq.block_table
            ids += seq.token_ids[start:end]
            pos += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            if s.request.params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                prompt_spans[seq.seq_id] = (start, len(ids) - (end - start), len(ids))
            q_starts.append(len(ids))
            seq_lens.append(end)
            if s.sample:
                sample_idx.append(len(ids) - 1)
        width = max(-(-n // bs) for n in seq_lens)
        tables = [s.seq.block_table[:width] + [0] * (width - len(s.seq.block_table[:width])) for s in out.scheduled]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(q_starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            max_query_len=max(b - a for a, b in zip(q_starts, q_starts[1:], strict=False)),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=q_starts,
            seq_lens_cpu=seq_lens,
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        positions = torch.tensor(pos, dtype=torch.int64, device=dev)
        return input_ids, positions, meta, torch.tensor(sample_idx, dtype=torch.int64, device=dev), prompt_spans
