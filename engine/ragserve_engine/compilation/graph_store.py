"""Precompiled decode graphs on disk: a warm start loads each capture size instead of re-tracing it.

Inductor's cache spares a warm start the code generation, not dynamo: every size was traced again (~2,200
ops of SmolLM2, 4-8 s a size on 2 cores, bench/results/cold-start-smollm2.md). torch's AOT precompile
(torch.compile(...).aot_compile) keeps the traced bytecode, its guards and the compiled code (the .so
bundled) in one file per size; loading it costs ~1 s and traces nothing. The file's name holds everything
the graph depends on that inductor's key held and a trace would have seen: the model signature, the KV
cache's layout, the size, the thread count (the C++ is generated for it), the inductor options, the Python
and the engine's own source (decode_forward and the model code are not traced again: an edit must miss).
It lives in the compile cache directory (torch version and ISA in its name), beside inductor's .so files:
torch's format is a pickle, trusted as those are (whoever can write the directory can run code anyway).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from ragserve_engine.compilation.compile_cache import INDUCTOR_OPTIONS, compile_cache_dir

logger = logging.getLogger(__name__)
ENGINE_SRC = Path(__file__).parents[1]
_LOADED: dict[Path, Callable] = {}  # engines of one process share a loaded size


@functools.cache
def engine_source_hash() -> str:
    """The engine package's Python source: the code a loaded graph was traced from."""
    digest = hashlib.sha256()
    for path in sorted(ENGINE_SRC.rglob("*.py")):
        digest.update(path.relative_to(ENGINE_SRC).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def graph_path(signature: str, kv: torch.Tensor, size: int) -> Path:
    parts = [signature, kv.device.type, str(kv.dtype), str(tuple(kv.shape[1:])), str(size)]
    parts += [str(torch.get_num_threads()), repr(sorted(INDUCTOR_OPTIONS.items())), sys.version, engine_source_hash()]
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]
    return compile_cache_dir() / "decode-graphs" / f"b{size}-{key}.bin"


def load(path: Path, f_globals: dict) -> Callable | None:
    """The precompiled graph at path, or None (absent, or written by something this process cannot load)."""
    if path in _LOADED:
        return _LOADED[path]
    if not path.is_file():
        return None
    try:
        with path.open("rb") as f:
            fn = torch.compiler.load_compiled_function(f, f_globals=f_globals)
    except Exception as exc:  # a torch upgrade that kept the version string, a truncated copy: trace again
        logger.warning("cannot load the precompiled decode graph %s (%s); compiling it", path, exc)
        return None
    _LOADED[path] = fn
    return fn


def compile_and_save(forward, args: tuple, path: Path) -> Callable:
    """Trace and compile forward for args (tensors marked dynamic where they must be), save it to path."""
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):  # one static graph per size
        fn = forward.aot_compile((args, {}))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fn.save_compiled_function(str(path))
    except Exception as exc:  # a read-only shipped cache: serve, compile again next start
        logger.warning("cannot save the precompiled decode graph to %s: %s", path, exc)
    _LOADED[path] = fn
    return fn
