"""The paged KV cache's tensors for a --kv-cache-dtype (quantized dtypes carry scales): allocation, swap copies,
and a block's bytes as the cachestore holds them (its data, then its int8 scales)."""

from __future__ import annotations

import ctypes
import math
import mmap
import sys
from dataclasses import dataclass

import numpy as np
import torch

from ragserve_engine.attention import quant
from ragserve_engine.attention.backend import LayerKVCache


@dataclass
class KVCacheTensors:
    data: torch.Tensor  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    scales: torch.Tensor | None  # int8: [num_blocks, num_layers, 2, block_size, num_kv_heads] float32
    kv_dtype: str  # canonical --kv-cache-dtype ("auto" = model dtype, "fp8" -> "fp8_e4m3")
    backed: bool = False  # back_all() ran: every block is resident, back() has nothing left to do

    def layers(self) -> list[LayerKVCache]:
        return [
            LayerKVCache(self.data[:, i], self.kv_dtype, None if self.scales is None else self.scales[:, i])
            for i in range(self.data.shape[1])
        ]

    def host_copy(self, num_blocks: int, pin: bool) -> KVCacheTensors:
        """An empty host-memory cache of the same layout (swap space)."""

        def alloc(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else torch.zeros((num_blocks, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)

        return KVCacheTensors(alloc(self.data), alloc(self.scales), self.kv_dtype)

    def copy_from(self, other: KVCacheTensors, src: list[int], dst: list[int]) -> None:
        """self[dst] = other[src], block by block (other may live on another device)."""
        self.data[dst] = other.data[src].to(self.data.device)
        if self.scales is not None:
            self.scales[dst] = other.scales[src].to(self.scales.device)

    @property
    def _data_nbytes(self) -> int:
        """Bytes of one block's data (without its scales)."""
        return self.data[0].numel() * self.data.element_size()

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block: data, then int8 scales."""
        n = self._data_nbytes
        if self.scales is not None:
            n += self.scales[0].numel() * self.scales.element_size()
        return n

    def gather(self, block_ids: list[int]) -> GatheredBlocks:
        """One copy of these blocks to host memory, started now (asynchronous on CUDA)."""
        ids = torch.tensor(block_ids, device=self.data.device)
        data = self.data.index_select(0, ids).to("cpu", non_blocking=True)
        scales = None
        if self.scales is not None:
            scales = self.scales.index_select(0, ids).to("cpu", non_blocking=True)
        return GatheredBlocks(data, scales, _copy_event(self.data.device))

    def back(self, block_ids: list[int]) -> None:
        """Have the OS back these blocks' memory now, their contents unchanged (Linux MADV_POPULATE_WRITE): a
        CPU cache's pages are zeroed as they are first written (zeros()), which costs the thread that writes
        first ~1.7 ms per 0.7 MB block on a VM; a fetch backs the blocks its KV will land in on the fetch thread,
        not the step thread. A no-op on other devices and where the kernel lacks it."""
        if self.data.device.type == "cpu" and block_ids and not self.backed:
            ids, size = sorted(set(block_ids)), self._data_nbytes
            populate_write([(self.data.data_ptr() + i * size, size) for i in ids])

    def back_all(self) -> None:
        """back() for every block (and the int8 scales)."""
        if self.data.device.type == "cpu":
            populate_write(
                [(t.data_ptr(), t.numel() * t.element_size()) for t in (self.data, self.scales) if t is not None]
            )
            self.backed = True

    def write_block(self, block_id: int, raw: bytes) -> None:
        """Block block_id = raw (block_nbytes bytes, as GatheredBlocks.block_bytes gives them)."""
        raw, size = memoryview(raw), self._data_nbytes
        _write(self.data[block_id], raw[:size])
        if self.scales is not None:
            _write(self.scales[block_id], raw[size:])


def _write(dst: torch.Tensor, raw: memoryview) -> None:
    """dst = raw's bytes: one copy on the CPU (a decode engine lands ~0.7 MB per fetched SmolLM2 block)."""
    if dst.device.type == "cpu":
        dst.view(torch.uint8).numpy().reshape(-1)[:] = np.frombuffer(raw, dtype=np.uint8)
    else:  # torch.frombuffer wants a writable buffer
        dst.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dst.dtype).view(dst.shape).to(dst.device))


@dataclass
class GatheredBlocks:
    """Blocks copied off the cache by one gather; on CUDA, `ready` marks the copy done."""

    data: torch.Tensor  # [n, num_layers, 2, block_size, num_kv_heads, head_dim], host memory
    scales: torch.Tensor | None
    ready: torch.cuda.Event | None = None

    def block_bytes(self, i: int) -> bytes:
        """The i-th block's bytes (waits for the copy): its data, then its scales."""
        if self.ready is not None:
            self.ready.synchronize()
        raw = self.data[i].contiguous().view(torch.uint8).numpy().tobytes()
        if self.scales is not None:
            raw += self.scales[i].contiguous().view(torch.uint8).numpy().tobytes()
        return raw


def kv_dtype_name(kv_cache_dtype: str, model_dtype: torch.dtype) -> str:
    """The KV layout's dtype: canonical --kv-cache-dtype and storage dtype ("auto:float32", "int8:int8")."""
    kv_dtype = quant.canonical(kv_cache_dtype)
    return f"{kv_dtype}:{str(quant.storage_dtype(kv_dtype, model_dtype)).removeprefix('torch.')}"


def bytes_per_block(kv_cache_dtype: str, model_dtype: torch.dtype, block_shape: tuple[int, ...]) -> int:
    """Bytes of one block (data + int8 scales); block_shape = (1, num_layers, 2, block_size, kv_heads, head_dim)."""
    numel = 1
    for d in block_shape:
        numel *= d
    size = numel * _element_size(quant.storage_dtype(kv_cache_dtype, model_dtype))
    if quant.has_scale_tensor(kv_cache_dtype):
        size += numel // block_shape[-1] * _element_size(quant.SCALE_DTYPE)
    return size


def allocate_kv_cache(
    kv_cache_dtype: str, model_dtype: torch.dtype, shape: tuple[int, ...], device: torch.device
) -> KVCacheTensors:
    """shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)."""
    kv_dtype = quant.canonical(kv_cache_dtype)
    data = zeros(shape, quant.storage_dtype(kv_dtype, model_dtype), device)
    scales = None
    if quant.has_scale_tensor(kv_dtype):
        scales = torch.ones(shape[:-1], dtype=quant.SCALE_DTYPE, device=device)
    return KVCacheTensors(data, scales, kv_dtype)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on the CPU from calloc'd memory (numpy), whose pages the OS zeroes as they are first written:
    the cache costs no start-up time or resident memory for blocks never used (torch.zeros writes every byte)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = torch.from_numpy(np.zeros(math.prod(shape) * _element_size(dtype), dtype=np.uint8))
    return raw.view(dtype).view(shape)


def populate_write(ranges: list[tuple[int, int]]) -> None:
    """madvise(MADV_POPULATE_WRITE) over each (address, length), widened to whole pages: the pages are backed
    and writable, their bytes as they were (a page shared with a neighbouring block is safe to populate). Off for
    good after the first refusal (a kernel before 5.14, or not Linux); ctypes releases the GIL meanwhile."""
    if _MADVISE["off"]:
        return
    libc, page = _MADVISE.get("libc"), mmap.PAGESIZE
    if libc is None:
        libc = _MADVISE["libc"] = ctypes.CDLL(None, use_errno=True)
    for addr, length in ranges:
        start = addr - addr % page
        end = -(-(addr + length) // page) * page
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_POPULATE_WRITE) != 0:
            _MADVISE["off"] = True
            return


MADV_POPULATE_WRITE = 23  # linux/mman.h, Linux 5.14
_MADVISE: dict = {"off": not sys.platform.startswith("linux")}


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _copy_event(device: torch.device) -> torch.cuda.Event | None:
    """On CUDA, an event the reader of a gathered copy waits on."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event
