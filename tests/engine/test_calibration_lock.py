"""Engines starting together on one host calibrate one at a time (server/calibration.py's host lock), so
none measures the others' start-up; a held lock delays readiness, never serving for good."""

from __future__ import annotations

import fcntl
import os
import time

import httpx

from ragserve_engine.server.calibration import LOCK_PATH
from tests.helpers import process
from tests.helpers.engine_server import start_engine


def ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_an_engine_waits_for_the_host_calibration_lock(tmp_path):
    fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT, 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another engine calibrating on this host
    engine = start_engine(tmp_path, "--num-gpu-blocks", "64", "--max-model-len", "256")
    try:
        process.until(lambda: "waiting for another engine on this host" in engine.output(), timeout=120,
                      what="the engine waiting for the lock")  # fmt: skip
        time.sleep(1.0)
        assert not ready(engine.url)  # loaded, but not measured: not ready
        os.close(fd)  # the other engine is done
        fd = -1
        engine.wait_ready()
        assert "calibrated in" in engine.output()
    finally:
        if fd >= 0:
            os.close(fd)
        engine.stop()
