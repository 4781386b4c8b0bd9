"""Torch threads under `make test`'s xdist workers.

Each worker, and every server it starts, inherits OMP_NUM_THREADS = its share of the cores. Two workers each
running torch on every core oversubscribe a 2-core machine, and OpenMP's spinning then made CPU-bound tests
5-10x slower (SmolLM2's parity passes: 9.6 s instead of 2.3 s with the other worker busy).
"""

from __future__ import annotations

import os

SET_HERE = "RAGSERVE_TEST_SHARED_THREADS"  # marks an OMP_NUM_THREADS that share_cores set, not the user


def share_cores() -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0))
    os.environ["OMP_NUM_THREADS"] = str(max(1, cores // workers))
    os.environ[SET_HERE] = "1"


def user_threads() -> int | None:
    """OMP_NUM_THREADS as the user set it for the run (None: unset, or set by share_cores)."""
    value = os.environ.get("OMP_NUM_THREADS")
    return int(value) if value and SET_HERE not in os.environ else None


def without_shared_threads(env: dict[str, str]) -> dict[str, str]:
    """env for a process that divides the cores itself (`ragserve up`): share_cores' setting removed."""
    if SET_HERE in env:
        env = {k: v for k, v in env.items() if k not in (SET_HERE, "OMP_NUM_THREADS")}
    return env
