"""Where compiled artefacts live, keyed by what they depend on, and how to tell a cache hit from a compile.

Inductor keeps its generated C++ (and the .so files, and AOTAutograd's graphs) under TORCHINDUCTOR_CACHE_DIR;
its FX-graph cache key already holds the graph (the model's config constants and parameter shapes: the model
signature, compilation/decode_graphs.py), the inductor config and torch's version. What it leaves out, and a
cache that travels between machines needs, is the ISA: a .so generated for AVX512 on one node would crash
on an AVX2 node that shares the volume. So the directory is RAGSERVE_CACHE_DIR/inductor/<torch>-<isa>.
The thread count stays in inductor's key (its C++ is generated for torch.get_num_threads(): which loops
run in parallel, and on how many threads), so one directory holds a set of graphs per thread count and a pod
with another CPU request than the cache's compiles its own. cpp.dynamic_threads would take the count out,
but it puts an OpenMP parallel region around every kernel, however small: served decode steps of the tiny
model at 2 threads took 4.7 ms at batch 1 against main's 3.4 (1.4x; 1.15x at batch 2), without it 3.5 ms
(bench/results/decode-step-ab.md). A TORCHINDUCTOR_CACHE_DIR set by the user wins.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from ragserve.model_source import cache_dir

ENV = "TORCHINDUCTOR_CACHE_DIR"
# inductor options of every torch.compile of the engine: none but inductor's defaults (not
# cpp.dynamic_threads: see above); bench/decode_graph_policy.py sets some to compare
INDUCTOR_OPTIONS: dict[str, object] = {}


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
    """Graphs inductor generated code for in this process: an FX-graph cache miss (torch.compile), or an
    AOTAutograd cache miss (aot_compile, which bundles inductor's output in that cache); a hit loads the .so.
    Dynamo not imported yet: nothing compiled (importing it costs seconds an eager engine need not pay)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_miss"] + counters["aot_autograd"]["autograd_cache_miss"])
