"""Blender: runs the blended prefill of requests that mark chunks, and the rest of a step through ModelRunner.

A blend request is scheduled whole (scheduler) and without prefix hits; its prefill loads each
chunk's K/V from the ChunkStore (computing and storing missing ones at the canonical position),
re-rotates the keys to the chunk's real position, runs blend_forward and writes every row's K/V
into the sequence's paged blocks, so decoding continues like any other request.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import numpy as np
import torch

from ragserve.keys import chunk_key
from ragserve_engine.attention.backend import slot_mapping
from ragserve_engine.blend.forward import KVSink, ReusePlan, blend_forward
from ragserve_engine.blend.remote import RemoteChunks
from ragserve_engine.blend.rope import rerotate
from ragserve_engine.blend.spec import BlendSpec, BlendUsage, Selection
from ragserve_engine.blend.store import ChunkStore
from ragserve_engine.block_pool import KVEvent
from ragserve_engine.model_runner import ModelOutput, ModelRunner
from ragserve_engine.scheduler_output import ScheduledSeq, SchedulerOutput

log = logging.getLogger(__name__)


class Blender:
    def __init__(
        self,
        runner: ModelRunner,
        root: bytes,
        recompute_fraction: float,
        store_bytes: int,
        canonical_prefix: list[int] = (),
        cachestore=None,
        selection: Selection | None = None,
        listener: Callable[[KVEvent], None] | None = None,
    ) -> None:
        """`cachestore`: a CacheStoreClient; chunks are then shared with every engine of the same layout.
        `listener` is told each chunk key stored or evicted (a KV event)."""
        self.runner = runner
        self.model = runner.model
        self.root = root
        self.recompute_fraction = recompute_fraction
        self.store = ChunkStore(store_bytes, listener)
        self.canonical_prefix = list(canonical_prefix)
        self.selection = selection or Selection()
        self.counters = BlendUsage()  # cumulative over every blended prefill
        self.failed: dict[str, Exception] = {}  # request id -> what failed its blended prefill this step
        self.remote = RemoteChunks(cachestore, runner.layout) if cachestore is not None else None

    # ---- a step -------------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> ModelOutput:
        """The step's outputs. A blended prefill that raises fails its request alone: it leaves
        out.scheduled and is reported by take_failed (the engine then drops it)."""
        blended = [s for s in out.scheduled if _is_blend_prefill(s)]
        if not blended:
            return self.runner.execute(out)
        ids = {id(s) for s in blended}
        rest = dataclasses.replace(out, scheduled=[s for s in out.scheduled if id(s) not in ids])
        base = self.runner.execute(rest) if rest.scheduled else None
        if base is None:
            self.runner.copy_blocks(rest)
        mine = {}
        for s in blended:
            try:
                mine[id(s)] = self.prefill(s.seq.token_ids, s.seq.block_table, s.request.blend)
            except Exception as exc:  # noqa: BLE001 - this request's alone
                log.exception("blended prefill of request %s failed", s.request.request_id)
                self.failed[s.request.request_id] = exc
        out.scheduled[:] = [s for s in out.scheduled if s.request.request_id not in self.failed]
        rows, i = [], 0
        for s in out.scheduled:
            if id(s) in mine:
                rows.append(mine[id(s)])
            elif s.sample:
                rows.append(base.logits[i])
                i += 1
        logits = torch.stack(rows) if rows else torch.empty(0, device=self.runner.device)
        return ModelOutput(logits, base.prompt_logits if base else {})

    def take_failed(self) -> dict[str, Exception]:
        failed, self.failed = self.failed, {}
        return failed

    # ---- one blended prefill ------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, token_ids: list[int], block_table: list[int], spec: BlendSpec) -> torch.Tensor:
        """Blend the prompt into its paged blocks; returns the last token's logits."""
        dev, n, bs = self.runner.device, len(token_ids), self.runner.layout.block_size
        slots = slot_mapping(np.array([block_table]), np.zeros(n, np.int64), np.arange(n), bs)
        slots = torch.from_numpy(slots).to(dev)

        def write(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            self.runner.backend.write_kv(k, v, self.runner.kv_layers[layer], slots)

        return self.blend(token_ids, spec, write)

    @torch.inference_mode()
    def blend(self, token_ids: list[int], spec: BlendSpec, sink: KVSink) -> torch.Tensor:
        """The blended forward of the prompt, every layer's K/V to `sink`; sets spec.usage and returns the
        last token's logits."""
        dev, n = self.runner.device, len(token_ids)
        plan = self.plan(token_ids, spec)
        ids = torch.tensor(token_ids, dtype=torch.int64, device=dev)
        hidden, rows = blend_forward(self.model, ids, torch.arange(n, device=dev), plan, sink)
        assert int(rows[-1]) == n - 1, "the last token is always computed"
        kept = torch.ones(n, dtype=torch.bool, device=dev)
        kept[rows] = False  # every kept row is a chunk row: non-chunk rows are always computed
        computed_chunk = int((kept & plan.fresh).sum())
        spec.usage = BlendUsage(n - len(rows) - computed_chunk, computed_chunk, len(rows))
        self.counters.add(spec.usage)
        return self.model.compute_logits(hidden[-1:])[0]

    def plan(self, token_ids: list[int], spec: BlendSpec) -> ReusePlan:
        """Stored chunk K/V laid out at the chunks' real positions, which rows they cover, and which of those
        come from chunks computed for this request (a chunk repeated in the prompt is computed once)."""
        n, cfg = len(token_ids), self.model.config
        dev, dtype = self.runner.device, self.runner.dtype
        old = torch.zeros((cfg.num_layers, 2, n, cfg.num_kv_heads, cfg.head_dim), dtype=dtype, device=dev)
        reusable = torch.zeros(n, dtype=torch.bool, device=dev)
        fresh = torch.zeros(n, dtype=torch.bool, device=dev)
        computed_now: set[tuple[int, ...]] = set()
        rotary = self.model.layers[0].self_attn.rotary
        for start, stop in spec.spans:
            chunk = tuple(token_ids[start:stop])
            kv, existed = self.chunk_kv(list(chunk), spec.cache_salt)
            if not existed or chunk in computed_now:
                computed_now.add(chunk)
                fresh[start:stop] = True
            old[:, 0, start:stop] = rerotate(kv[:, 0], start - len(self.canonical_prefix), rotary)
            old[:, 1, start:stop] = kv[:, 1]
            reusable[start + min(self.selection.sink_tokens, stop - start) : stop] = True
        reusable[n - 1] = False  # the last token's logits are sampled: always computed
        num_chunk = sum(b - a for a, b in spec.spans)
        forced = num_chunk - int(reusable.sum())  # sink tokens (and a last token in a chunk) count as recomputed
        num = max(0, spec.num_recompute(num_chunk, self.recompute_fraction) - forced)
        sel = self.selection
        check = min(sel.check_layer, cfg.num_layers - 1)
        layers = min(sel.filter_layers, cfg.num_layers - check)  # the final count is reached by the last layer
        return ReusePlan(old, reusable, num, check, layers, sel.filter_start, sel.value_weight, fresh)

    # ---- chunks -------------------------------------------------------------------------------
    def chunk_kv(self, token_ids: list[int], cache_salt: str | None) -> tuple[torch.Tensor, bool]:
        """[num_layers, 2, n, kvh, d] of a chunk at the canonical position, and whether it existed: from the
        store or the cachestore (True), or computed now and stored in both (False)."""
        key = chunk_key(self.root, token_ids, self.canonical_prefix, cache_salt)
        kv = self.store.get(key)
        if kv is None and self.remote is not None:
            kv = self.remote.get(key, len(token_ids), self.runner.dtype, self.runner.device)
            if kv is not None:
                self.store.put(key, kv)
        if kv is not None:
            return kv, True
        kv = self.compute_chunk(token_ids)
        self.store.put(key, kv)
        if self.remote is not None:
            self.remote.put(key, kv)
        return kv, False

    @torch.inference_mode()
    def compute_chunk(self, token_ids: list[int]) -> torch.Tensor:
        """The chunk's K/V prefilled alone after the canonical prefix, keys rotated at positions P.."""
        dev, skip = self.runner.device, len(self.canonical_prefix)
        tokens = self.canonical_prefix + list(token_ids)
        layers: list[torch.Tensor] = []

        def keep(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            layers.append(torch.stack((k[skip:], v[skip:])))

        ids = torch.tensor(tokens, dtype=torch.int64, device=dev)
        blend_forward(self.model, ids, torch.arange(len(tokens), device=dev), None, keep)
        return torch.stack(layers).to(self.runner.dtype)


def _is_blend_prefill(s: ScheduledSeq) -> bool:
    return getattr(s.request, "blend", None) is not None and s.seq.num_computed_tokens == 0 and s.sample
