"""Start-up calibration (vLLM's profile run, for the router's cost model): before the server reports ready it
prefills synthetic prompts and decodes a few tokens at batch 3 and 1, so the first heartbeat already carries
a measured prefill rate and decode step line, its slope included (batch sizes 2 and 1 could never vary
enough for load_stats.MIN_X_VARIANCE: two values a step apart have a variance of at most 0.25), and the
fused ops compile now rather than in the first user request. Its decode steps run eager (the compiled decode
graphs are set aside meanwhile, so no background compile starts beside them and spoils the samples,
compilation/events.py); the heartbeat says so (DECODE_EAGER_BEFORE_GRAPHS) until a compiled graph has timed
a step, and from then on it carries the graph's own line (fitted apart, load_stats), so the router never
compares an eager figure with a peer's graph figure (router/cost_model.py).

Engines that start together on one machine (a local stack, a test fleet) would measure each other, so a
host-wide lock file lets one calibrate at a time (a pod's /tmp is its own: pods never wait for each other).

The synthetic requests leave no trace a client or the router can see: each has a random cache_salt, and
they run inside EngineClient.calibrating(): the cachestore connector is detached (no lookup, no offload),
and afterwards the prefix cache is reset (no KV event is recorded before registration starts) and the
prefix-cache and computed-token counters are zeroed. They never pass through the HTTP layer, so request
metrics do not count them.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from ragserve_engine.engine_client import EngineClient, SamplingParams

log = logging.getLogger("ragserve_engine.server")
PROMPT_TOKENS = 256  # per prompt: one step of fused ops (>= fused.MIN_TOKENS), a few on a capped engine
DECODE_STEPS = 4  # per batch size (CALIBRATION_BATCH, then 1)
CALIBRATION_BATCH = 3  # batch sizes 3 and 1, DECODE_STEPS each: a decayed variance of ~0.96, over MIN_X_VARIANCE
LOCK_PATH = Path(tempfile.gettempdir()) / "ragserve-calibration.lock"
LOCK_WAIT_S = 120.0  # then calibrate anyway: a slow measurement beats never serving
WORDS = ("the", "engine", "measures", "its", "speed", "before", "it", "serves", "a", "prompt")


def synthetic_prompt(llm: EngineClient, num_tokens: int, seed: int) -> list[int]:
    text = " ".join(f"{WORDS[(seed + i) % len(WORDS)]} {seed * 1000 + i}" for i in range(num_tokens))
    return llm.tokenizer.encode(text)[:num_tokens]


async def _generate(llm: EngineClient, prompt: list[int], max_tokens: int) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    salt, rid = uuid.uuid4().hex, f"calibration-{uuid.uuid4().hex}"
    async for _ in llm.generate(prompt, params, rid, cache_salt=salt):
        pass


@contextlib.asynccontextmanager
async def host_turn(path: Path = LOCK_PATH, wait_s: float = LOCK_WAIT_S) -> AsyncIterator[None]:
    """Hold the host's calibration lock (flock: released if the process dies) while the block runs."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:  # e.g. another user's lock file: measure without it
        log.warning("calibration: no host lock (%s); calibrating alone is not guaranteed", exc)
        yield
        return
    try:
        deadline, waiting = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waiting:
                    log.info("calibration: waiting for another engine on this host to finish calibrating")
                    waiting = True
                if time.monotonic() > deadline:
                    log.warning("calibration: lock still held after %.0f s; calibrating anyway", wait_s)
                    break
                await asyncio.sleep(0.1)
        yield
    finally:
        os.close(fd)


async def calibrate(llm: EngineClient) -> None:
    """Run the calibration requests, one engine on this host at a time; a failure is logged and the server
    serves unmeasured."""
    async with host_turn():
        await _calibrate(llm)


async def _calibrate(llm: EngineClient) -> None:
    t0 = time.perf_counter()
    n = max(1, min(PROMPT_TOKENS, llm.info.max_model_len - 2 * DECODE_STEPS - 2))
    async with llm.calibrating():
        try:
            await _generate(llm, synthetic_prompt(llm, n, 0), 1)  # compiles the fused ops: not a speed sample
            # prefilled together, then DECODE_STEPS steps decoding all of them and DECODE_STEPS decoding one;
            # admitted as one batch: on a busy machine the step thread could start the first before the others
            # arrived, and the staggered prompts then left too few steps at the full batch to fit a slope
            async with llm.steps_held():
                batch = [asyncio.create_task(_generate(llm, synthetic_prompt(llm, n, 1), 1 + 2 * DECODE_STEPS))]
                batch += [
                    asyncio.create_task(_generate(llm, synthetic_prompt(llm, n, s), 1 + DECODE_STEPS))
                    for s in range(2, CALIBRATION_BATCH + 1)
                ]
                while await llm.num_requests() < len(batch) and not any(t.done() for t in batch):
                    await asyncio.sleep(0.01)
            await asyncio.gather(*batch)
        except Exception:  # noqa: BLE001 - serving matters more than the measurement
            log.exception("start-up calibration failed; the router uses its defaults until requests are measured")
    stats = llm.stats()
    log.info(
        "calibrated in %.1f s: prefill %.0f tokens/s, decode step %.2f ms + %.2f ms a sequence",
        time.perf_counter() - t0, stats.prefill_tokens_per_s, 1000 * stats.decode_step_s, 1000 * stats.decode_seq_s,
    )  # fmt: skip
