"""Cold start (issue 37): an engine compiles its decode graphs before it reports ready, so a ready engine has
no compile pending, and a second engine on the same compile cache (and thread count: inductor's key holds
it) generates no code and traces nothing (it loads the precompiled graphs). Offline, LLM compiles at
construction unless told not to."""

from __future__ import annotations

import httpx
import torch
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from ragserve_engine.compilation.compile_cache import cache_key, compile_cache_dir
from ragserve_engine.llm import LLM
from ragserve_engine.sampling_params import SamplingParams
from tests.helpers.engine_server import MODEL_NAME, start_engine
from tests.helpers.tiny_models import tiny_model

# two capture sizes (1, 2) keep the cold compiles of the first engine to a few seconds each; steps of at most 64
# tokens keep calibration's prefills under layers/fused.py's compiled ops (steps of 128 tokens or more): the decode
# graphs are the subject, and the fused ops' compiles cost each engine seconds more before /ready
FLAGS = ("--no-enforce-eager", "--max-num-seqs", "2", "--num-gpu-blocks", "64", "--max-model-len", "256")
FLAGS += ("--max-num-batched-tokens", "64")


def _gauges(url: str) -> dict[str, float]:
    label = f'{{model_name="{MODEL_NAME}"}}'
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("ragserve:decode_graph") and label in line:
            name, value = line.split(label)
            out[name.removeprefix("ragserve:")] = float(value)
    return out


def _serve_once(tmp_path, threads: int) -> tuple[dict[str, float], str]:
    """Start an engine on tmp_path's compile cache, take its gauges at /ready and after a request, stop it."""
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "OMP_NUM_THREADS": str(threads)}
    engine = start_engine(tmp_path, *FLAGS, env=env)
    try:
        engine.wait_ready(timeout=300)
        at_ready = _gauges(engine.url)
        body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
        resp = httpx.post(engine.url + "/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4
        assert _gauges(engine.url) == at_ready  # serving compiled nothing more
    finally:
        code = engine.stop()
    log = engine.output()
    assert code == 0, log[-3000:]
    return at_ready, log


def test_a_ready_engine_compiles_nothing_and_a_second_engine_generates_nothing(tmp_path):
    first, log = _serve_once(tmp_path, threads=1)
    # one line per size, then the wait ends, then calibration, then ready
    order = ["(generated; 2 of 2 sizes)", "decode graphs ready", "calibrated in", f"serving {MODEL_NAME}"]
    where = [log.find(line) for line in order]
    assert -1 not in where and where == sorted(where), (where, log[-3000:])
    assert first["decode_graphs_compiled"] == 2 and first["decode_graphs_pending"] == 0
    assert first["decode_graph_cache_misses"] == 2 and first["decode_graph_compile_seconds"] > 0
    # code generated for one thread runs no OpenMP region: cpp.dynamic_threads (no thread count in the cache
    # key) would put one around every kernel, and made served decode steps up to 1.4x slower at 2 threads
    code = {p.name: p.read_text() for p in (tmp_path / "inductor").rglob("*.cpp")}
    assert code and not [name for name, c in code.items() if "#pragma omp parallel" in c]
    # another pod on the same cache volume, with the same CPU request: every graph loads from the cache
    second, log = _serve_once(tmp_path, threads=1)
    assert second["decode_graphs_compiled"] == 2 and second["decode_graphs_pending"] == 0
    assert second["decode_graph_cache_misses"] == 0, log[-3000:]
    # and traces nothing: each size loads its precompiled graph (compilation/graph_store.py)
    assert log.count("(precompiled: loaded;") == 2 and "traced" not in log, log[-3000:]
    # a precompiled graph that cannot be loaded (a truncated copy) is traced again, and rewritten
    (saved,) = (tmp_path / "inductor" / "decode-graphs").glob("b1-*.bin")
    saved.write_bytes(saved.read_bytes()[:100])
    third, log = _serve_once(tmp_path, threads=1)
    assert third["decode_graphs_compiled"] == 2 and third["decode_graphs_pending"] == 0
    assert "cannot load the precompiled decode graph" in log and "(precompiled: loaded; 2 of 2 sizes)" in log
    assert log.count("(precompiled: loaded;") == 1 and saved.stat().st_size > 100  # rewritten whole


def test_offline_llm_compiles_at_construction_unless_told_not_to():
    path = str(tiny_model("llama"))
    eager = LLM(path, num_gpu_blocks=32, max_num_seqs=2, enforce_eager=True)
    model = eager.engine.runner.model
    lazy = LLM(path, num_gpu_blocks=32, max_num_seqs=2, loaded_model=model, compile_at_start=False)
    assert lazy.engine.runner.decode_graphs.stats.compiled == []
    llm = LLM(path, num_gpu_blocks=32, max_num_seqs=2, loaded_model=model, cuda_graph_sizes=[2])
    graphs = llm.engine.runner.decode_graphs
    assert graphs.stats.compiled == [2] and graphs.sizes == [2]  # the configured list, compiled already
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[100, 7, 9], [200, 8]]
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens == [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    assert graphs.stats.compiled == [2] and graphs.stats.steps > 0  # ran its graph, compiled nothing more


def test_the_compile_cache_directory_is_keyed_by_torch_and_isa(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("RAGSERVE_CACHE_DIR", str(tmp_path))
    key = cache_key()
    assert torch.__version__ in key and torch.backends.cpu.get_cpu_capability().lower() in key
    assert compile_cache_dir() == tmp_path / "inductor" / key
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what importing inductor sets
    assert compile_cache_dir() == tmp_path / "inductor" / key
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache_dir() == tmp_path / "mine"  # the user's choice wins
