"""A GGUF file's metadata and tensor index in one pass over its header; tensor bytes stay memory-mapped.

The `gguf` package's GGUFReader builds a numpy view per value: ~5 s for SmolLM2's 49k-token vocabulary,
paid at every engine start. This reads the same header with `struct` (~0.1 s); dequantizing still uses
`gguf.dequantize`. Little-endian GGUF v2/v3 only (what llama.cpp has written since 2023).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
         7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}  # fmt: skip
PLAIN = {  # ggml types whose data numpy reads as elements (the rest: rows of quantized blocks, as uint8)
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # numpy order (slowest dimension first)
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # as gguf.GGUFReader gives it: elements for plain types, uint8 block rows otherwise


@dataclass(frozen=True)
class GGUFFile:
    metadata: dict[str, Any]  # arrays as lists (of str) or numpy arrays (of numbers)
    tensors: list[GGUFTensor]

    def tensor_names(self) -> set[str]:
        return {t.name for t in self.tensors}


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, kind: int):
        fmt = "<" + SCALARS[kind]
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        (n,) = struct.unpack_from("<Q", self.buf, self.pos)
        start = self.pos + 8
        self.pos = start + n
        return bytes(self.buf[start : self.pos]).decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind == STRING:
            return self.string()
        if kind != ARRAY:
            return self.scalar(kind)
        item, count = self.scalar(4), self.scalar(10)
        if item == STRING:
            return [self.string() for _ in range(count)]
        if item == ARRAY:
            return [self.value(self.scalar(4)) for _ in range(count)]  # nested: each carries its own type
        dtype = np.dtype(NUMPY[item]).newbyteorder("<")
        out = np.frombuffer(self.buf, dtype, count, self.pos).copy()
        self.pos += count * dtype.itemsize
        return out


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file's header; raises ValueError for anything that is not a v2/v3 little-endian GGUF."""
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mapped))
    if bytes(cur.buf[:4]) != MAGIC:
        raise ValueError(f"{path}: not a GGUF file")
    cur.pos = 4
    version = cur.scalar(4)
    if version not in VERSIONS:
        raise ValueError(f"{path}: GGUF version {version} (big-endian?) is not supported; need one of {VERSIONS}")
    n_tensors, n_kv = cur.scalar(10), cur.scalar(10)
    try:
        metadata = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.scalar(4))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.scalar(10) for _ in range(cur.scalar(4))]
            infos.append((name, tuple(reversed(dims)), GGMLQuantizationType(cur.scalar(4)), cur.scalar(10)))
    except (struct.error, KeyError, ValueError) as exc:
        raise ValueError(f"{path}: malformed GGUF header: {exc}") from exc
    align = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-cur.pos // align) * align
    return GGUFFile(metadata, [_tensor(mapped, start, *info) for info in infos])


def _tensor(mapped: np.ndarray, start: int, name: str, shape, qtype: GGMLQuantizationType, offset: int) -> GGUFTensor:
    block, type_size = GGML_QUANT_SIZES[qtype]
    count = int(np.prod(shape))
    begin, end = start + offset, start + offset + count * type_size // block
    if end > len(mapped):
        raise ValueError(f"tensor {name} runs past the end of the file")
    raw = mapped[begin:end]
    if qtype in PLAIN:
        return GGUFTensor(name, shape, qtype, raw.view(PLAIN[qtype]).reshape(shape))
    return GGUFTensor(name, shape, qtype, raw.reshape(quant_shape_to_byte_shape(shape, qtype)))
