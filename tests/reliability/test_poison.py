"""One request never hurts another: per-request fault isolation in the engine.

In process (AsyncLLM, tiny model): a failure injected inside the step for one request fails that
request alone; its batch mates finish with exactly the tokens they produce without it, and the KV
cache is whole afterwards. A failure that belongs to no request fails everyone as an EngineError.
Real process (`ragserve engine` with the same fault injected): the poisoned request gets a 500
(or an SSE error event) with scope `request`, a lone-surrogate cache_salt a 400, a step failure a
500 with scope `engine`; four bystander streams are unaffected and the engine keeps serving. The bad
requests overlap the bystanders by construction: those ask for 400 tokens, and each bad request goes in
only once all four streamed a chunk and the engine's running gauge counts exactly them (and still does
after it answered).
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ragserve.engine_args import EngineConfig
from ragserve.metric_names import NUM_REQUESTS_RUNNING
from ragserve_engine import sample_step, sampler
from ragserve_engine.async_engine import AsyncLLM
from ragserve_engine.outputs import EngineError, RequestError
from ragserve_engine.sampling_params import SamplingParams
from tests.helpers.engine_server import MODEL_NAME, EngineProc, metric, scrape
from tests.helpers.net import free_port
from tests.helpers.process import start, until
from tests.helpers.tiny_models import tiny_model

POISON = 999  # a prompt that starts with this token id is the poisoned one (in process)
MATES = [
    ([11, 12, 13, 14, 15], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)),
    (list(range(200, 260)), SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True)),
    ([7] * 20, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)),
    ([300, 301], SamplingParams(temperature=1.0, seed=9, top_k=20, max_tokens=24, n=2, ignore_eos=True)),
]


@pytest.fixture(scope="module")
def engine():
    # graphs compile as steps need them (on its compile thread), as before compile_at_start: poison is tested
    llm = AsyncLLM(EngineConfig(model=str(tiny_model("llama")), num_gpu_blocks=96, compile_at_start=False))
    yield llm
    llm.shutdown()


async def _run(engine: AsyncLLM, rid: str, prompt: list[int], params: SamplingParams):
    last = None
    async for out in engine.generate(prompt, params, rid):
        last = out
    return [c.token_ids for c in last.outputs]


def run_batch(engine: AsyncLLM, tag: str, poisoned: bool) -> tuple[list, BaseException | None]:
    """The batch mates, with a poisoned request among them if asked; returns their tokens and its error."""

    async def main():
        jobs = [_run(engine, f"{tag}-{i}", p, params) for i, (p, params) in enumerate(MATES)]
        if poisoned:
            poison = SamplingParams(max_tokens=24, ignore_eos=True)
            jobs.append(_run(engine, f"{tag}-poison", [POISON, 1, 2, 3], poison))
        return await asyncio.gather(*jobs, return_exceptions=True)

    results = asyncio.run(main())
    return results[: len(MATES)], (results[-1] if poisoned else None)


def _poisoned(req) -> bool:
    return req.prompt_token_ids[0] == POISON


def inject_in_stop_check(monkeypatch):
    real = sample_step.check_stop

    def check_stop(req, seq, criteria):
        if _poisoned(req) and len(seq.output_token_ids) >= 3:
            raise RuntimeError("injected fault in the stop check")
        real(req, seq, criteria)

    monkeypatch.setattr(sample_step, "check_stop", check_stop)


def inject_in_sampler(monkeypatch):
    real = sampler.Sampler._sample_row

    def sample_row(self, logits, row):
        if row.prompt_ids[0] == POISON and len(row.output_ids) >= 2:
            raise IndexError("injected fault in the sampler")
        return real(self, logits, row)

    monkeypatch.setattr(sampler.Sampler, "_sample_row", sample_row)


@pytest.mark.parametrize("inject", [inject_in_stop_check, inject_in_sampler])
def test_a_request_failing_in_the_step_fails_alone(engine, monkeypatch, inject):
    baseline, _ = run_batch(engine, f"base-{inject.__name__}", poisoned=False)
    inject(monkeypatch)
    mates, error = run_batch(engine, f"poisoned-{inject.__name__}", poisoned=True)
    assert isinstance(error, RequestError) and "injected fault" in str(error), error
    assert mates == baseline  # same tokens, seeded sampling and n=2 included
    monkeypatch.undo()
    until(lambda: engine.stats().free_blocks == engine.stats().total_blocks, timeout=10, what="KV blocks freed")
    assert not engine.engine.requests and run_batch(engine, "after", poisoned=False)[0] == baseline


def test_a_step_failure_of_no_single_request_fails_all_as_engine_error(engine, monkeypatch):
    real, calls = engine.engine.runner.execute, []

    def execute(out):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected device fault")
        return real(out)

    monkeypatch.setattr(engine.engine.runner, "execute", execute)
    mates, _ = run_batch(engine, "dead", poisoned=False)
    assert all(isinstance(m, EngineError) for m in mates), mates
    monkeypatch.undo()
    assert all(isinstance(m, list) for m in run_batch(engine, "alive", poisoned=False)[0])


# ---- a real engine process with the fault injected -------------------------------------------

INJECT = """
import sys
from ragserve_engine import llm_engine, sample_step
real_stop, real_step = sample_step.check_stop, llm_engine.LLMEngine.step

def check_stop(req, seq, criteria):
    if req.prompt and "POISON" in req.prompt and len(seq.output_token_ids) >= 3:
        raise RuntimeError("injected fault in the stop check")
    real_stop(req, seq, criteria)

def step(self):
    if any(r.prompt and "ENGINE-FAULT" in r.prompt for r in self.requests.values()):
        raise RuntimeError("injected device fault")
    return real_step(self)

sample_step.check_stop, llm_engine.LLMEngine.step = check_stop, step
from ragserve.cli import main
sys.exit(main())
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp, port = tmp_path_factory.mktemp("poison"), free_port()
    argv = [sys.executable, "-c", INJECT, "engine", "--model", str(tiny_model("llama")), "--served-model-name"]
    argv += [MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512"]
    argv += ["--num-gpu-blocks", "256"]
    proc = start("engine", argv, tmp / "engine.log")
    engine = EngineProc(proc.name, proc.popen, proc.log, port)
    try:
        engine.wait_ready()
        yield engine
    finally:
        assert engine.stop() == 0, engine.output()[-3000:]


def stream_tokens(url: str, body: dict, first: threading.Event | None = None) -> tuple[list[int], list[str]]:
    """A stream's token ids and its SSE data lines; `first` is set once its first chunk arrived."""
    body = {"model": MODEL_NAME, "stream": True, "return_token_ids": True, **body}
    tokens, lines = [], []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            lines.append(line[6:])
            if line[6:] != "[DONE]" and "error" not in json.loads(line[6:]):
                tokens += [t for c in json.loads(line[6:])["choices"] for t in c["token_ids"]]
            if first is not None:
                first.set()
    return tokens, lines


BYSTANDER_TOKENS = 400  # hundreds of decode steps: none can end while a bad request (a few steps) runs
BYSTANDERS = [
    {"prompt": f"Bystander {i} asks about paged attention.", "max_tokens": BYSTANDER_TOKENS, "temperature": 0,
     "ignore_eos": True}
    for i in range(4)
]  # fmt: skip


def running(url: str) -> int:
    return int(metric(scrape(url), NUM_REQUESTS_RUNNING))


def with_bystanders(url: str, *bad) -> tuple[list[list[int]], list]:
    """Four greedy streams; once each has its first chunk and the engine runs exactly them, each `bad()` runs
    in turn and the engine must still be running all four after it; returns their tokens and the results."""
    firsts = [threading.Event() for _ in BYSTANDERS]
    with ThreadPoolExecutor(len(BYSTANDERS)) as pool:
        futures = [pool.submit(stream_tokens, url, b, e) for b, e in zip(BYSTANDERS, firsts, strict=True)]
        until(lambda: all(e.is_set() for e in firsts) or any(f.done() for f in futures), timeout=60, what="streams")
        assert all(e.is_set() for e in firsts), [f.result() for f in futures if f.done()]
        until(lambda: running(url) == len(BYSTANDERS), timeout=10, interval=0.02, what="the bystanders running")
        results = []
        for call in bad:
            results.append(call())
            assert running(url) == len(BYSTANDERS), "the bad request must overlap the bystanders"
        mates = [f.result()[0] for f in futures]
    assert all(len(m) == BYSTANDER_TOKENS for m in mates), [len(m) for m in mates]
    return mates, results


@pytest.fixture(scope="module")
def baseline(server):
    with ThreadPoolExecutor(len(BYSTANDERS)) as pool:
        mates = list(pool.map(lambda b: stream_tokens(server.url, b)[0], BYSTANDERS))
    assert all(len(m) == BYSTANDER_TOKENS for m in mates)
    return mates


def post(url: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    content = json.dumps({"model": MODEL_NAME, **body})  # ASCII: a lone surrogate travels as a \u escape
    return httpx.post(url + path, content=content, headers={"Content-Type": "application/json"}, timeout=60)


SALT = {"prompt": "Hello there", "max_tokens": 4, "cache_salt": "\ud800"}
POISON_PILL = {"prompt": "POISON pill", "max_tokens": 32, "ignore_eos": True}


@pytest.fixture(scope="module")
def overlapped(server):
    """One run of the bystanders with each bad request going in, in turn: their tokens and {name: result}."""
    bad = {
        "cache_salt": lambda: post(server.url, SALT),
        "poison": lambda: post(server.url, POISON_PILL),
        "poison_stream": lambda: stream_tokens(server.url, POISON_PILL),
    }
    mates, results = with_bystanders(server.url, *bad.values())
    return mates, dict(zip(bad, results, strict=True))


def test_lone_surrogate_cache_salt_is_400_and_bystanders_unaffected(overlapped, baseline):
    mates, results = overlapped
    resp = results["cache_salt"]
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "cache_salt", resp.text
    assert resp.headers["x-ragserve-error-scope"] == "request"
    assert mates == baseline


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages.0.content"),
        ("/v1/completions", {"prompt": ["Hello there", "\ud800"]}, "prompt.1"),
    ],
)
def test_lone_surrogates_in_prompts_are_400(server, path, body, param):
    resp = post(server.url, body, path)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_request_failing_in_the_step_is_a_request_scoped_500(overlapped, baseline):
    mates, results = overlapped
    resp, (_, lines) = results["poison"], results["poison_stream"]
    assert resp.status_code == 500 and resp.headers["x-ragserve-error-scope"] == "request", resp.text
    error = json.loads(lines[-1])["error"]
    assert error["scope"] == "request" and "[DONE]" not in lines, lines
    assert mates == baseline


def test_engine_wide_failure_is_engine_scoped_and_the_engine_recovers(server, baseline):
    resp = post(server.url, {"prompt": "ENGINE-FAULT now", "max_tokens": 4})
    assert resp.status_code == 500 and resp.headers["x-ragserve-error-scope"] == "engine", resp.text
    assert httpx.get(server.url + "/ready", timeout=10).status_code == 200
    again = stream_tokens(server.url, {**BYSTANDERS[0], "max_tokens": 48})[0]
    assert again == baseline[0][:48]  # greedy: the first 48 tokens of the same answer
