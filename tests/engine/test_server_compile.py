"""A served engine with --no-compile-at-start and its decode graphs: requests never wait for a compile (they
run eager while it runs in the background), and a SIGTERM while a graph compiles still drains and exits 0
(teardown under an in-flight inductor compile aborts the process)."""

from __future__ import annotations

import httpx

from tests.helpers.engine_server import MODEL_NAME, start_engine


def test_sigterm_during_a_background_compile_exits_cleanly(tmp_path):
    # an empty inductor cache: the tiny model's first graph takes seconds to compile, not milliseconds. Steps of at
    # most 64 tokens: calibration's prefills never reach layers/fused.py's compiled ops (steps of 128 tokens or
    # more), which cost ~15 s of cold compiles before /ready and are not what this test is about
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    flags = ("--no-enforce-eager", "--no-compile-at-start", "--num-gpu-blocks", "64", "--max-model-len", "256")
    flags += ("--max-num-batched-tokens", "64")
    engine = start_engine(tmp_path, *flags, env=env)
    try:
        engine.wait_ready()
        body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
        resp = httpx.post(engine.url + "/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3  # decoded eager
        exported = httpx.get(engine.url + "/metrics", timeout=10).text
        assert f'ragserve:decode_graphs_pending{{model_name="{MODEL_NAME}"}} 1.0' in exported  # batch 1 compiling
        assert f'ragserve:decode_graphs_compiled{{model_name="{MODEL_NAME}"}} 0.0' in exported
    finally:
        code = engine.stop()
    log = engine.output()
    assert code == 0, log[-3000:]
    assert "exiting with a decode graph compile in flight" in log  # the case under test happened
