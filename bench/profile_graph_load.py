"""Where a warm start's decode-graph load goes (issue 37): cProfile and dynamo's compile metrics of capture().

    RAGSERVE_CACHE_DIR=<a warm cache> OMP_NUM_THREADS=2 python bench/profile_graph_load.py MODEL [MAX_NUM_SEQS]

Builds an LLM without compiling, then compiles (or loads) every capture size under cProfile and prints the
seconds per size, the inductor / AOTAutograd cache counters and dynamo's timing of each phase (tracing,
inductor load, guard building). Findings: bench/results/cold-start-smollm2-profile.md.
"""

from __future__ import annotations

import cProfile
import logging
import pstats
import sys
import time

from torch._dynamo.utils import compile_times, counters

from ragserve_engine.llm import LLM


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    model, max_num_seqs = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1
    t0 = time.perf_counter()
    llm = LLM(model, max_num_seqs=max_num_seqs, num_gpu_blocks=256, max_model_len=512, compile_at_start=False)
    print(f"LLM() {time.perf_counter() - t0:.1f} s")
    graphs = llm.engine.runner.decode_graphs
    profile = cProfile.Profile()
    profile.enable()
    graphs.capture()
    profile.disable()
    print("seconds per size", {s: round(t, 2) for s, t in graphs.stats.compile_seconds.items()})
    print({k: dict(v) for k, v in counters.items() if k in ("inductor", "aot_autograd", "stats")})
    print(compile_times(repr="str", aggregate=True))
    pstats.Stats(profile).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
