"""Compiled decode graphs: the CPU analogue of vLLM's CUDA-graph capture.

A decode-only step (one new token per sequence) runs the whole model, embedding to logits, paged
attention included, as one torch.compile'd graph (inductor: C++ on CPU); the graph returns the step's
K/V and one index_copy_ per K and V writes all layers' into the cache after it. The batch is padded up
to a capture size (vLLM's cudagraph_capture_sizes: 1, 2, 4, 8, 16, 24, 32, 64, ...) so each size is one
graph (padding rows attend to their own token and write nothing); the block-table width and the number
of KV blocks are dynamic dimensions, so neither context growth nor another pool size recompiles. On CPU
the graph's wrapper is C++ (inductor's cpp_wrapper), so a step costs one call instead of ~25
Python-dispatched ops per layer. Weights stay graph inputs (not frozen constants): every engine in the
process whose model has the same signature (config, module types, parameter shapes) shares the graphs,
and no size holds a copy of the weights. Each signature compiles its own copy of decode_forward, so
dynamo's guards on the model (~5,000 on SmolLM2: every parameter's metadata, every module attribute) are
dropped: the signature already fixes them, and checking them cost ~0.7 ms of an int4 single-stream step
(bench/results/decode-guards-ab.txt).

Graphs compile before the engine serves (compile_at_start, vLLM's capture at start-up): LLM compiles every
capture size at construction (capture()), a server queues them all on its compile thread and reports ready
once none is pending (capture_in_background()), logging one line per size, so no request waits for a
compile and none shares the cores with one. Each size traced is saved precompiled (torch's aot_compile:
bytecode, guards and code in one file, compilation/graph_store.py): a restart, or another pod on the same
cache volume, loads it (~1 s a size) instead of tracing the model again (4-8 s a size on SmolLM2); inductor's
on-disk cache (compilation/compile_cache.py) spares a trace the code generation.
With --no-compile-at-start a size compiles the first time a step of that size runs: offline (LLM) the step
waits for its compile, a server runs that step eager and compiles the size on its thread (compile_in_background;
a cold SmolLM2 graph takes 60-100 s on 2 cores). Steps
with a prefill, prompt logprobs, a quantized KV cache, more sequences than the largest capture size or
a context over --max-seq-len-to-capture run the eager model. Off with --enforce-eager.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ragserve_engine.attention.backend import AttentionMetadata, slot_mapping
from ragserve_engine.compilation import cpu_ops, graph_store
from ragserve_engine.compilation.compile_cache import INDUCTOR_OPTIONS, cache_misses
from ragserve_engine.compilation.events import COMPILE_THREAD, compiling
from ragserve_engine.compilation.graph_attention import GraphDecodeAttention, GraphLayerCache, write_new_kv
from ragserve_engine.layers.attention import ForwardContext
from ragserve_engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)
MAX_CAPTURE_SIZE = 512
RECOMPILE_LIMIT = 1024  # graphs one model signature may hold, all sizes together


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to 32, then powers of two, up to max_num_seqs (vLLM-like)."""
    sizes = [1, 2, 4] + list(range(8, 33, 8))
    while sizes[-1] < min(max_num_seqs, MAX_CAPTURE_SIZE):
        sizes.append(sizes[-1] * 2)
    return [s for s in sizes if s < max_num_seqs] + [min(max_num_seqs, sizes[-1])]


@dataclass
class GraphStats:
    steps: int = 0  # decode steps run by a compiled graph
    compiled: list[int] = field(default_factory=list)  # capture sizes compiled, in order
    compile_seconds: dict[int, float] = field(default_factory=dict)
    failed: set[int] = field(default_factory=set)  # sizes whose compile raised: they stay eager
    cache_misses: int = 0  # compiles that generated code (an inductor cache miss) rather than loading it
    traced: int = 0  # sizes dynamo traced (the rest loaded precompiled, compilation/graph_store.py)

    @property
    def total_compile_seconds(self) -> float:
        return sum(self.compile_seconds.values())


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_data: torch.Tensor,
        sizes: list[int],
        max_seq_len_to_capture: int,
    ) -> None:
        """kv_data: the whole cache [num_blocks, layers, 2, block_size, KVH, D]."""
        self.model, self.kv_data = model, kv_data
        self.sizes, self.max_seq_len = sorted(sizes), max_seq_len_to_capture
        self.device = kv_data.device
        self.stats = GraphStats()
        self.signature = model_signature(model)
        self.forward = _compiled(self.device, self.signature)  # traces a size whose precompiled graph is absent
        self._graphs: dict[int, Callable] = {}
        self._todo: queue.Queue | None = None  # background mode: sizes to compile
        self._queued: set[int] = set()
        if self.device.type == "cpu":
            cpu_ops.load()  # before any trace: the graphs call the C++ attention if it builds

    def size_for(self, num_seqs: int, max_seq_len: int) -> int | None:
        """The capture size a step of num_seqs runs at, or None (eager; in the background mode also while
        that size compiles)."""
        if max_seq_len > self.max_seq_len:
            return None
        size = next((s for s in self.sizes if s >= num_seqs), None)
        if self._todo is None or size is None or size in self.stats.compile_seconds:
            return size
        if size not in self._queued:
            self._queued.add(size)
            self._todo.put(size)
        return None

    @property
    def num_pending(self) -> int:
        """Sizes a step asked for that the background thread has not compiled (or failed to) yet."""
        return len(self._queued - self.stats.compile_seconds.keys() - self.stats.failed)

    def capture(self) -> None:
        """Compile every capture size now, on this thread (offline: before the first step)."""
        with torch.inference_mode():  # as the step thread: dynamo guards on grad mode
            for size in self.sizes:
                if size not in self.stats.compile_seconds:
                    self.run(size, [], np.zeros(0, np.int64), np.zeros((0, 2), np.int64))

    def capture_in_background(self) -> None:
        """Queue every capture size on the compile thread; ready to serve once num_pending is 0."""
        self.compile_in_background()
        for size in self.sizes:
            if size not in self._queued and size not in self.stats.compile_seconds:
                self._queued.add(size)
                self._todo.put(size)

    def compile_in_background(self) -> None:
        """From now on a step never compiles: sizes compile on a thread of their own (one at a time)."""
        if self._todo is None:
            self._todo = queue.Queue()
            self._thread = threading.Thread(target=self._compile_loop, name=COMPILE_THREAD, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """No more compiles; one in flight runs to its end (dynamo cannot be interrupted)."""
        if self._todo is not None:
            self._todo.put(None)
            self._thread.join(timeout=1.0)  # an idle thread ends at once

    def _compile_loop(self) -> None:
        while (size := self._todo.get()) is not None:
            try:
                with torch.inference_mode():  # as the step thread: dynamo guards on grad mode
                    self.run(size, [], np.zeros(0, np.int64), np.zeros((0, 2), np.int64))
            except Exception:  # the step thread keeps running eager for this size
                self.stats.failed.add(size)
                logger.exception("compiling the decode graph for batch %d failed; that size stays eager", size)

    def run(self, size: int, token_ids: list[int], positions: np.ndarray, tables: np.ndarray) -> torch.Tensor:
        """Logits [n, vocab] of n one-token sequences: token_ids [n], positions [n] (the new token's),
        tables [n, width] (block ids, padded with anything). n = 0 compiles the size (all rows padding)."""
        n, bs = len(token_ids), self.kv_data.shape[3]  # the cache's block size
        width = max(2, tables.shape[1])  # width 1 would be specialised by dynamo: one more graph
        ids = np.zeros(size, np.int64)
        ids[:n] = token_ids
        pos = np.zeros(size, np.int64)
        pos[:n] = positions
        table = np.zeros((size, width), np.int64)  # padding rows read block 0, masked: they see only themselves
        table[:n, : tables.shape[1]] = tables
        lens = np.ones(size, np.int64)
        lens[:n] = pos[:n] + 1
        inputs = [torch.from_numpy(a).to(self.device) for a in (ids, pos, table, lens)]
        if size not in self.stats.compile_seconds:
            self._compile(size, inputs)
        logits, keys, values = self._call(size, inputs)
        if n:
            slots = slot_mapping(table, np.arange(n), pos[:n], bs)
            write_new_kv(self.kv_data, torch.from_numpy(slots).to(self.device), keys[:, :n], values[:, :n])
            self.stats.steps += 1
        return logits[:n]

    def _compile(self, size: int, inputs: list[torch.Tensor]) -> None:
        """Load the size's precompiled graph (graph_store), or trace it (inductor generates the code or loads
        it from its cache) and save it for the next start."""
        t0, misses = time.perf_counter(), cache_misses()
        path = graph_store.graph_path(self.signature, self.kv_data, size)
        with compiling():
            fn = graph_store.load(path, decode_forward.__globals__)
            if fn is None:
                table, kv = inputs[2].clone(), self.kv_data.view(self.kv_data.shape)  # marked: not the callers'
                torch._dynamo.mark_dynamic(table, 1)
                torch._dynamo.mark_dynamic(kv, 0)  # pools of any size share a size's graph
                fn = graph_store.compile_and_save(self.forward, (self.model, kv, *inputs[:2], table, inputs[3]), path)
                how = "generated" if cache_misses() > misses else "traced, code from the compile cache"
            else:
                how = "precompiled: loaded"
            self._graphs[size] = fn
            self._call(size, inputs)  # the first call of a loaded graph, before any step needs it
        seconds = self.stats.compile_seconds[size] = time.perf_counter() - t0
        self.stats.compiled.append(size)
        self.stats.cache_misses += how == "generated"
        self.stats.traced += how != "precompiled: loaded"
        logger.info(
            "compiled the decode graph for batch %d in %.1f s (%s; %d of %d sizes)",
            size, seconds, how, len(self.stats.compiled), len(self.sizes),
        )  # fmt: skip

    def _call(self, size: int, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return self._graphs[size](self.model, self.kv_data, *inputs)


_BACKEND = GraphDecodeAttention()
_COMPILED: dict[tuple[str, str], Callable] = {}


def decode_forward(
    model: LlamaForCausalLM, kv, input_ids, positions, block_tables, seq_lens
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's forward and logits for one-token sequences, with the graph attention backend, and the
    step's keys and values [layers, batch, KVH, D] for the caller to write. Parameters are graph inputs,
    not constants: engines whose models share a signature share the graphs."""
    meta = AttentionMetadata(None, seq_lens, seq_lens, block_tables, 1, 0, [], [])  # no slot_mapping: no writes
    new_kv: list[tuple[torch.Tensor, torch.Tensor]] = []
    caches = [GraphLayerCache(kv, i, new_kv) for i in range(kv.shape[1])]
    hidden = model(input_ids, positions, ForwardContext(meta, _BACKEND, caches))
    keys = torch.stack([k for k, _ in new_kv])
    values = torch.stack([v for _, v in new_kv])
    return model.compute_logits(hidden), keys, values


def model_signature(model: torch.nn.Module) -> str:
    """What a graph specialises on besides its inputs: the config (constants such as eps or rope theta),
    each module's type and each parameter's and buffer's name, shape, dtype and strides."""
    parts = [repr(getattr(model, "config", None))]
    parts += [f"{name}:{type(m).__qualname__}" for name, m in model.named_modules()]
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        parts.append(f"{name}:{tuple(t.shape)}:{t.dtype}:{t.stride()}:{t.device}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _unguarded_by_model(entries) -> list[bool]:
    """dynamo guard filter: keep the guards on the step's inputs and global state, drop those on the model
    (its signature picked the function), on module globals (constants of this module) and dynamo's
    duplicate-input checks (~550 on SmolLM2), and those torch cannot save with a precompiled graph."""
    from torch._dynamo.guards import CheckFunctionManager

    unsaved = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    return [
        not e.name.startswith("model") and not e.is_global and e.guard_type not in ("DUPLICATE_INPUT", *unsaved)
        for e in entries
    ]


def _compiled(device: torch.device, signature: str) -> Callable:
    fn = _COMPILED.get((device.type, signature))
    if fn is None:
        # dynamo keeps compiled graphs on the code object: one copy of decode_forward's code per signature
        code = decode_forward.__code__.replace(co_name=f"decode_forward_{signature}")
        forward = types.FunctionType(code, decode_forward.__globals__, code.co_name)
        # Per compile, not via torch._dynamo.config: dynamo's config settings are thread-local, and
        # engines step on their own threads. Each capture size is one entry.
        options = {"cpp_wrapper": device.type == "cpu", "guard_filter_fn": _unguarded_by_model, **INDUCTOR_OPTIONS}
        fn = _COMPILED[(device.type, signature)] = torch.compile(
            forward, fullgraph=True, options=options, recompile_limit=RECOMPILE_LIMIT
        )
    return fn
