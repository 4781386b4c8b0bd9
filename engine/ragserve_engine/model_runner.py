"""ModelRunner: owns the model and the paged KV cache; turns a SchedulerOutput into logits."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from ragserve.engine_args import EngineConfig
from ragserve.keys import KVLayout
from ragserve.model_source import ModelSource, model_fingerprint
from ragserve_engine.attention.backend import AttentionMetadata, slot_mapping
from ragserve_engine.attention.kv_cache import KVCacheTensors, allocate_kv_cache, bytes_per_block, kv_dtype_name
from ragserve_engine.attention.selector import get_attention_backend
from ragserve_engine.compilation.decode_graphs import DecodeGraphs, capture_sizes
from ragserve_engine.layers import fused
from ragserve_engine.layers.attention import ForwardContext
from ragserve_engine.layers.packed_linear import can_pack, pack_weights
from ragserve_engine.layers.quant_linear import quantize_weights
from ragserve_engine.models.llama import LlamaForCausalLM
from ragserve_engine.models.loader import load_model
from ragserve_engine.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)
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
        if config.quantization != "none" and model is None:
            quantize_weights(self.model, config.quantization)
        elif model is None and not config.enforce_eager and can_pack(self.device, self.dtype):
            pack_weights(self.model)
        self.model_config = self.model.config
        fused.set_compile(not config.enforce_eager)
        self.backend = get_attention_backend(config.attention_backend, self.device, config.kv_cache_dtype)
        c = self.model_config
        # the engine's one holder of its block size (and KV dtype, model id): every reader takes it from here
        self.layout = KVLayout(
            model_fingerprint(source), kv_dtype_name(config.kv_cache_dtype, self.dtype), config.block_size,
            c.num_layers, c.num_kv_heads, c.head_dim,
        )  # fmt: skip
        self.bytes_per_block = bytes_per_block(config.kv_cache_dtype, self.dtype, self._block_shape(1))
        self.num_blocks = self._num_blocks()
        self.kv_cache = allocate_kv_cache(
            config.kv_cache_dtype, self.dtype, self._block_shape(self.num_blocks), self.device
        )
        self.kv_layers = self.kv_cache.layers()
        self.decode_graphs = None
        if self._use_decode_graphs():
            sizes = sorted(set(config.cuda_graph_sizes)) or capture_sizes(config.max_num_seqs)
            self.decode_graphs = DecodeGraphs(self.model, self.kv_cache.data, sizes, config.max_seq_len_to_capture)
        self.num_swap_blocks = int(config.swap_space * (1 << 30)) // self.bytes_per_block
        self.host_cache: KVCacheTensors | None = None  # allocated on first swap-out

    def _use_decode_graphs(self) -> bool:
        """Whole-model compiled decode: CPU, model-dtype KV cache, not --enforce-eager."""
        c = self.config
        return not c.enforce_eager and self.device.type == "cpu" and c.kv_cache_dtype == "auto"

    def _block_shape(self, n: int) -> tuple[int, ...]:
        layout = self.layout
        return (n, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)

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
                self.host_cache = self.kv_cache.host_copy(self.num_swap_blocks, pin=self.device.type == "cuda")
            dev, host = map(list, zip(*out.swap_out, strict=True))
            self.host_cache.copy_from(self.kv_cache, dev, host)
        if out.swap_in:
            host, dev = map(list, zip(*out.swap_in, strict=True))
            self.kv_cache.copy_from(self.host_cache, host, dev)
        if out.copies:
            src, dst = map(list, zip(*out.copies, strict=True))
            self.kv_cache.copy_from(self.kv_cache, src, dst)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelOutput:
        self.copy_blocks(out)
        if self.decode_graphs is not None and (logits := self._execute_graph(out)) is not None:
            return ModelOutput(logits, {})
        input_ids, positions, meta, sample_idx, prompt_spans = self._prepare(out)
        ctx = ForwardContext(meta, self.backend, self.kv_layers)
        hidden = self.model(input_ids, positions, ctx)
        logits = self.model.compute_logits(hidden[sample_idx])
        prompt_logits = {
            seq_id: (start, self.model.compute_logits(hidden[lo:hi]))
            for seq_id, (start, lo, hi) in prompt_spans.items()
        }
        return ModelOutput(logits, prompt_logits)

    def _execute_graph(self, out: SchedulerOutput) -> torch.Tensor | None:
        """A decode-only step through a compiled graph; None when the step is not one (eager then)."""
        sched = out.scheduled
        if not sched or any(s.num_new_tokens != 1 or not s.sample for s in sched):
            return None
        seqs = [s.seq for s in sched]
        if any(s.request.params.prompt_logprobs is not None and q.num_computed_tokens < q.num_prompt_tokens - 1
               for s, q in zip(sched, seqs, strict=True)):  # fmt: skip
            return None
        pos = np.fromiter((q.num_computed_tokens for q in seqs), np.int64, len(seqs))
        size = self.decode_graphs.size_for(len(seqs), int(pos.max()) + 1)
        if size is None:
            return None
        width = int(pos.max()) // self.layout.block_size + 1
        tables = np.zeros((len(seqs), width), np.int64)
        for i, q in enumerate(seqs):
            table = q.block_table[:width]
            tables[i, : len(table)] = table
        ids = [q.token_ids[p] for q, p in zip(seqs, pos.tolist(), strict=True)]
        try:
            return self.decode_graphs.run(size, ids, pos, tables)
        except Exception:  # e.g. no C++ compiler, or an op inductor cannot lower: stay eager, say why once
            logger.exception("compiled decode graph failed; running eager from now on (as with --enforce-eager)")
            self.decode_graphs = None
            return None

    def _prepare(self, out: SchedulerOutput):
        """Inputs of one step in one pass: Python gathers per-sequence scalars, numpy does the per-token work."""
        bs, sched = self.layout.block_size, out.scheduled
        n = len(sched)
        starts = np.fromiter((s.seq.num_computed_tokens for s in sched), np.int64, n)
        q_lens = np.fromiter((s.num_new_tokens for s in sched), np.int64, n)
        ends = starts + q_lens
        q_starts = np.zeros(n + 1, np.int64)
        np.cumsum(q_lens, out=q_starts[1:])
        width = int(-(-ends.max() // bs))
        tables = np.zeros((n, width), np.int64)
        ids: list[int] = []
        sample_idx, prompt_spans = [], {}
        for i, s in enumerate(sched):
            seq, start, end = s.seq, int(starts[i]), int(ends[i])
            table = seq.block_table[:width]
            tables[i, : len(table)] = table
            ids += seq.token_ids[start:end]
            if s.request.params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                prompt_spans[seq.seq_id] = (start, int(q_starts[i]), int(q_starts[i + 1]))
            if s.sample:
                sample_idx.append(int(q_starts[i + 1]) - 1)
        row = np.repeat(np.arange(n), q_lens)
        pos = np.arange(q_starts[-1]) - q_starts[row] + starts[row]
        slots = slot_mapping(tables, row, pos, bs)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc=torch.from_numpy(q_starts.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(ends.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(tables.astype(np.int32)).to(dev),
            max_query_len=int(q_lens.max()),
            max_seq_len=int(ends.max()),
            query_start_loc_cpu=q_starts.tolist(),
            seq_lens_cpu=ends.tolist(),
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        positions = torch.from_numpy(pos).to(dev)
        return input_ids, positions, meta, torch.tensor(sample_idx, dtype=torch.int64, device=dev), prompt_spans
