"""Decode-graph policy A/B (issue 37): compile seconds and step time per batch size for one static graph per
capture size (1, 2, 4, 8; padded) against one graph with a dynamic batch dimension (size 1 static, 2..8
dynamic), each with or without inductor's cpp.dynamic_threads (the thread count out of the code and the cache
key). One configuration per process, each on an empty compile cache:

    python bench/decode_graph_policy.py static|dyn 0|1 MODEL   # prints one JSON line

Results: bench/results/decode-graph-policy.md.
"""

import json
import sys
import time

import numpy as np
import torch

from ragserve_engine.compilation import decode_graphs as dg
from ragserve_engine.llm import LLM

mode, dyn_threads, model = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
dg.INDUCTOR_OPTIONS["cpp.dynamic_threads"] = dyn_threads
llm = LLM(model, num_gpu_blocks=256, max_num_seqs=8, compile_at_start=False)
g = llm.engine.runner.decode_graphs
res = {"mode": mode, "dyn_threads": dyn_threads, "compile": {}, "step_ms": {}}
sizes = [1, 2, 4, 8] if mode == "static" else [1, 2]
if mode == "dyn":
    orig_call = g._call

    def call(inputs):
        if inputs[0].shape[0] > 1:
            for t in inputs:
                torch._dynamo.mark_dynamic(t, 0, min=2, max=8)
        return orig_call(inputs)

    g._call = call
with torch.inference_mode():
    for s in sizes:
        t0 = time.perf_counter()
        g.run(s, [], np.zeros(0, np.int64), np.zeros((0, 2), np.int64))
        res["compile"][s] = round(time.perf_counter() - t0, 2)
        res.setdefault("misses", []).append(g.stats.cache_misses)
    for n in [1, 2, 3, 4, 8]:
        size = n if mode == "dyn" else next(s for s in sizes if s >= n)
        pos = np.full(n, 100, np.int64)
        tables = np.tile(np.arange(8), (n, 1)) + 8 * np.arange(n)[:, None]
        ids = [5] * n
        for _ in range(5):
            g.run(size, ids, pos, tables)
        ts = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(20):
                g.run(size, ids, pos, tables)
            ts.append((time.perf_counter() - t0) / 20 * 1000)
        res["step_ms"][n] = round(sorted(ts)[3], 3)
    res["graphs"] = len(g.stats.compiled)
print(json.dumps(res))
