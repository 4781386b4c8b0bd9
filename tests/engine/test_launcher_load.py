"""An engine whose model loaded but which fails on the way to serving it (an exception in the server's attach, its
calibration or its registration) exits non-zero with the error logged, instead of answering "loading" forever."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

from ragserve.engine_args import EngineConfig, ServerConfig
from ragserve.keys import KVLayout
from ragserve.tokenizer import PromptTokenizer
from ragserve_engine.server import launcher
from ragserve_engine.server.engine_server import FAILED, READY, EngineServer
from ragserve_engine.sim.engine import SimCost, SimEngine
from tests.helpers.tiny_models import tiny_model

LAYOUT = KVLayout("tiny@launcher-test", "float32", 16, 2, 2, 16)


def started(fail: bool, monkeypatch) -> tuple[EngineServer, SimpleNamespace, SimEngine]:
    sim = SimEngine(PromptTokenizer.from_dir(tiny_model("llama")), LAYOUT, 64, SimCost(1e7, 0.0, 0.0))
    server = EngineServer(ServerConfig(), EngineConfig(model=str(tiny_model("llama"))), "tiny")
    if fail:  # a fault on the way to serving (the token-cache collector's name error was one)
        monkeypatch.setattr(server.metrics, "attach_engine", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    uv = SimpleNamespace(exit_code=0, should_exit=False)
    asyncio.run(launcher.load(server, uv, lambda config: sim))
    return server, uv, sim


def test_a_failure_after_loading_exits_non_zero_and_logs_it(monkeypatch, caplog):
    with caplog.at_level(logging.ERROR, logger=launcher.log.name):
        server, uv, sim = started(True, monkeypatch)
    assert (server.status, uv.exit_code, uv.should_exit) == (FAILED, 1, True)
    assert "failed to start serving" in caplog.text and "boom" in caplog.text


def test_a_good_load_is_ready(monkeypatch):
    server, uv, sim = started(False, monkeypatch)
    try:
        assert (server.status, uv.exit_code, uv.should_exit) == (READY, 0, False)
    finally:
        sim.shutdown()
