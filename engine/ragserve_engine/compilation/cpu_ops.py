"""C++ ops for CPU decode graphs (csrc/cpu_ops.cpp), built once per machine and loaded at engine start.

- ragserve::paged_decode_attention: inductor's code for graph_attention.paged_decode_attention took
  ~20 ms of a batch-32 SmolLM2 step at 128-192 tokens of context (its masked softmax over the gathered
  keys is several passes of indirect, barely vectorised loads). The kernel reads each block once (online
  softmax, 16 rows' scores per vector, the next block prefetched): 13-16 ms, most of it waiting on memory.
- ragserve::int8_linear, ragserve::int8_group_linear and ragserve::int4_linear (csrc/quant_linear.cpp):
  --quantization int8's and int4's matmuls (int8 per channel, int8 per 32-group for int4's LM head, Q4_1)
  on blocked weights, float32 activations; used by layers/quant_linear.py in eager and compiled code alike.
- a CPU kernel for ragserve::packed_linear (the same oneDNN call as its Python one, which stays the
  fallback): no Python call per linear, 121 a step.

A compiled graph's C++ wrapper reaches both through the dispatcher (aoti_torch_call_dispatcher), with no
Python callback. torch.utils.cpp_extension builds the .so into RAGSERVE_CACHE_DIR/extensions/<name>, the
name a hash of the source, the ISA flags and torch's version, so a restart only loads it (a cold build
takes ~10 s). With no compiler, or any build error, the graphs keep inductor's attention and the Python
packed_linear, with one warning logged.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

import torch

from ragserve.model_source import cache_dir

logger = logging.getLogger(__name__)
SOURCES = [Path(__file__).parent / "csrc" / name for name in ("cpu_ops.cpp", "quant_linear.cpp")]
ISA_FLAGS = {  # torch's CPU capability -> the flags the kernels' vectors compile to
    "AVX512": ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-mfma", "-mavx2"],
    "AVX2": ["-mavx2", "-mfma"],
}
_state: dict[str, bool] = {}  # "loaded": the outcome of this process's one build/load attempt
_lock = threading.Lock()


def load() -> bool:
    """Build (or find built) and load the ops; True when torch.ops.ragserve.paged_decode_attention runs."""
    with _lock:
        if "loaded" not in _state:
            _state["loaded"] = _build()
        return _state["loaded"]


def loaded() -> bool:
    """Whether load() succeeded; read while tracing, so a graph calls the kernel only once it exists."""
    return _state.get("loaded", False)


def _build() -> bool:
    from torch.utils import cpp_extension

    import ragserve_engine.layers.packed_linear  # noqa: F401  (defines the op the .so adds a CPU kernel to)

    flags = ["-O3", "-fopenmp", *ISA_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES) + " ".join(flags).encode())
    digest.update(torch.__version__.encode())
    name = f"ragserve_cpu_ops_{digest.hexdigest()[:16]}"
    build_dir = cache_dir() / "extensions" / name
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name,
            [str(p) for p in SOURCES],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],  # at::parallel_for's OpenMP pragmas, as libtorch's own
            build_directory=str(build_dir),
            is_python_module=False,
        )
    except Exception:  # no compiler, no ninja, a read-only cache dir: the Python/inductor paths still work
        logger.warning("building the C++ CPU ops failed; decode graphs use inductor's attention", exc_info=True)
        return False
    torch.library.register_fake("ragserve::paged_decode_attention")(_fake)  # the schemas came with the .so
    torch.library.register_fake("ragserve::int8_linear")(_fake_int8_linear)
    torch.library.register_fake("ragserve::int8_group_linear")(_fake_int8_linear)
    torch.library.register_fake("ragserve::int4_linear")(_fake_int4_linear)
    logger.info("loaded the C++ CPU ops from %s", build_dir)
    return True


def _fake(query, key, value, kv_cache, layer, block_tables, seq_lens, scale) -> torch.Tensor:
    return torch.empty_like(query, memory_format=torch.contiguous_format)


def _fake_int8_linear(x, qweight, scales, bias, out_features) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def _fake_int4_linear(x, qweight, scales, mins, bias, out_features) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)
