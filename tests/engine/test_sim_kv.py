"""The sim engine's paged-KV model in process (no servers): hits, LRU eviction and the events it publishes."""

from __future__ import annotations

import subprocess
import sys

from ragserve.keys import KVLayout, block_hashes, root_hash
from ragserve_engine.sim.kv import SimKV, SimSeq

LAYOUT = KVLayout("tiny@sim-test", "float32", 16, 2, 2, 16)


def prompt(k: int, n: int = 80) -> list[int]:
    return [100 + k * 1000 + j for j in range(n)]


def run(kv: SimKV, ids: list[int]) -> SimSeq:
    """Admit, compute the prompt and free it (max_tokens 1: the prompt's full blocks end cached)."""
    seq = SimSeq(list(ids), len(ids), None)
    assert kv.admit(seq, len(ids) + 1)
    kv.cache(seq, len(ids))
    kv.free(seq)
    return seq


def test_hits_are_the_cached_prefix_and_never_the_last_token():
    kv = SimKV(LAYOUT, 64)
    assert run(kv, prompt(1)).num_cached_tokens == 0
    stored = [h for ev in kv.pool.take_events() if ev.kind == "stored" for h in ev.block_hashes]
    assert stored == block_hashes(prompt(1), 16, root_hash(LAYOUT.model_id))  # the router's keys, in chain order
    assert run(kv, prompt(1)).num_cached_tokens == 64  # 80 tokens: 5 full blocks, the last token recomputed
    assert run(kv, prompt(1, 81)).num_cached_tokens == 80
    assert (kv.queries, kv.hits) == (80 + 80 + 81, 64 + 80)


def test_lru_eviction_publishes_removed_blocks():
    kv = SimKV(LAYOUT, 12)  # room for two 5-block prompts (+1 block each for the generated token)
    run(kv, prompt(1))
    run(kv, prompt(2))
    kv.pool.take_events()
    run(kv, prompt(3))  # evicts the least recently freed blocks: prompt 1's, tail first
    removed = [h for ev in kv.pool.take_events() if ev.kind == "removed" for h in ev.block_hashes]
    assert set(removed) <= set(block_hashes(prompt(1), 16, root_hash(LAYOUT.model_id)))
    assert removed
    assert run(kv, prompt(2)).num_cached_tokens == 64  # prompt 2 survived


def test_admission_waits_for_blocks_instead_of_evicting_running_ones():
    kv = SimKV(LAYOUT, 8)
    held = SimSeq(prompt(1), 80, None)
    assert kv.admit(held, 81)  # 6 blocks, still running
    waiting = SimSeq(prompt(2), 80, None)
    assert not kv.admit(waiting, 81) and waiting.blocks == []
    kv.free(held)
    assert kv.admit(waiting, 81)


def test_the_sim_never_imports_torch():
    """256 sims share one process: the fleet's modules (and the engine server it reuses) stay torch-free."""
    code = "import sys, ragserve_engine.sim.fleet; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_eviction_takes_a_freed_prefix_from_its_tail():
    """Like the engine, a finished request frees its blocks tail first: what others reuse (the head) goes last."""
    kv = SimKV(LAYOUT, 14)
    run(kv, prompt(1))  # blocks 0-5 (5 full, 1 partial), freed 5, 4, ..., 0
    run(kv, prompt(2))  # blocks 6-11
    run(kv, prompt(3, 48))  # 4 blocks: the 2 never used, then prompt 1's partial block and its last full one
    assert run(kv, prompt(1, 81)).num_cached_tokens == 64  # blocks 0-3 of prompt 1 still hit


def test_warmup_pins_through_the_engine_server():
    """/v1/warmup (the real server's route) pins a sim's cached prefix, which then survives eviction, and
    unpins it. In process, through the server's ASGI app."""
    import asyncio

    import httpx

    from ragserve.engine_args import EngineConfig, ServerConfig
    from ragserve.model_source import load_tokenizer, resolve_model
    from ragserve_engine.sim.config import SimConfig
    from ragserve_engine.sim.fleet import SimMember, kv_layout
    from tests.helpers.tiny_models import tiny_model

    source = resolve_model(str(tiny_model("llama")), "tiny")
    ec = EngineConfig(model=str(source.path), served_model_name="tiny", num_gpu_blocks=16, max_model_len=256)
    member = SimMember.create(SimConfig(decode_base_s=0.0), ServerConfig(port=1, engine_id="w"), ec,
                              kv_layout(source, 16), load_tokenizer(source))  # fmt: skip
    member.start()
    doc = "Pinned knowledge: " + "block " * 60

    async def scenario() -> tuple[dict, list[int], dict]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=member.app), base_url="http://sim") as c:
            pinned = (await c.post("/v1/warmup", json={"model": "tiny", "texts": [doc], "pin": True})).json()
            cached = []
            for prompt in ("Other text " * 40, "More text " * 40, doc):  # more than the unpinned blocks hold
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
                cached.append((await c.post("/v1/completions", json=body)).json()["usage"]["prompt_tokens_details"])
            released = (await c.delete(f"/v1/warmup/{pinned['id']}")).json()
            return pinned, [d["cached_tokens"] for d in cached], released

    pinned, cached, released = asyncio.run(scenario())
    item = pinned["items"][0]
    assert item["num_pinned_blocks"] == item["num_blocks"] > 0
    assert cached[-1] == item["num_pinned_blocks"] * 16
    assert released["num_unpinned_blocks"] == item["num_pinned_blocks"]
    assert member.engine.kv.pool.num_free_blocks == 16


def test_sim_tokenizes_a_long_text_prompt_off_the_event_loop(monkeypatch):
    """As the engine does: over OFFLOAD_CHARS on a worker thread, with the ids the tokenizer gives."""
    import asyncio
    import threading

    from ragserve.tokenizer import OFFLOAD_CHARS, PromptTokenizer
    from ragserve_engine.sampling_params import SamplingParams
    from ragserve_engine.sim.engine import SimCost, SimEngine
    from tests.helpers.tiny_models import tiny_model

    tok = PromptTokenizer.from_dir(tiny_model("llama"))
    threads: list[threading.Thread] = []
    encode = tok.encode

    def recorded(text, *args, **kw):
        ids = encode(text, *args, **kw)
        threads.append(threading.current_thread())  # where it was encoded (an Uncached try on the loop is not)
        return ids

    text = "cluster " * (OFFLOAD_CHARS // 8 + 10)

    async def main():
        sim = SimEngine(tok, LAYOUT, 256, SimCost(prefill_tokens_per_s=1e7, decode_base_s=0.0))
        monkeypatch.setattr(tok, "encode", recorded)
        outs = [o async for o in sim.generate(text, SamplingParams(max_tokens=1), "long")]
        short = [o async for o in sim.generate("cluster", SamplingParams(max_tokens=1), "short")]
        return threading.current_thread(), outs[-1], short[-1]

    loop, long_out, short_out = asyncio.run(main())
    assert threads[0] is not loop and threads[1] is loop
    assert long_out.prompt_token_ids == encode(text) and short_out.finished
