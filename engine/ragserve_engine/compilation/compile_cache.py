"""Where compiled artefacts live, keyed by what they depend on, and how to tell a cache hit from a compile.

Inductor keeps its generated C++ (and the .so files, and AOTAutograd's graphs) under TORCHINDUCTOR_CACHE_DIR;
its FX-graph cache key already holds the graph (the model's config constants and parameter shapes: the model
signature, compilation/decode_graphs.py), the inductor config and torch's version. What it leaves out, and a
cache that travels between machines needs, is the ISA: a .so generated for AVX512 on one node would crash
on an AVX2 node that shares the volume. So the directory is RAGSERVE_CACHE_DIR/inductor/<torch>-<isa>.
The thread count is not in the key: every compile sets cpp.dynamic_threads (no measurable step cost,
bench/results/decode-graph-policy.md), so a pod with another CPU request reuses another's graphs. A
TORCHINDUCTOR_CACHE_DIR set by the user wins.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from ragserve.model_source import cache_dir

ENV = "TORCHINDUCTOR_CACHE_DIR"
# every torch.compile of the engine: C++ that reads the thread count at run time (omp_get_max_threads), so
# neither the code nor inductor's cache key depends on torch.get_num_threads()
INDUCTOR_OPTIONS = {"cpp.dynamic_threads": True}


def cache_key() -> str:
    """torch's version and the CPU ISA inductor's vectorized C++ compiles to (AVX512, AVX2, ...)."""
    return f"torch-{torch.__version__}-{torch.backends.cpu.get_cpu_capability().lower()}"


def compile_cache_dir() -> Path:
    """The inductor cache this process uses: TORCHINDUCTOR_CACHE_DIR if the user set it, else the keyed
    directory. Importing inductor writes its own default (/tmp/torchinductor_<user>) into the variable, so
    that value counts as unset: it is what made every engine share /tmp, whatever RAGSERVE_CACHE_DIR said."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    user = os.environ.get(ENV)
    if user and os.path.abspath(user) != os.path.abspath(default_cache_dir()):
        return Path(user)
    return cache_dir() / "inductor" / cache_key()


def use_compile_cache() -> Path:
    """Point inductor at compile_cache_dir() (before the first compile) and return it."""
    path = compile_cache_dir()
    os.environ[ENV] = str(path)
    return path


def cache_misses() -> int:
    """Graphs inductor generated code for in this process (an FX-graph cache miss; a hit loads the .so)."""
    return int(counters["inductor"]["fxgraph_cache_miss"])
