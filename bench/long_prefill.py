"""A burst of cold long prompts with short prompts arriving during it, on one engine: time to first token without a
per-step prefill cap, with --long-prefill-token-threshold alone (every long prompt shares each step), and with
--max-long-partial-prefills 1 as well (long prompts take turns; the default once a cap is set).

At t = 0 --long prompts of --long-tokens cold tokens each arrive together (16 output tokens); from t = 0.5 s a
--short-tokens prompt arrives every --short-every s (8 output tokens) until the burst would be over. The engine
steps as its server does (requests join between steps), eager (no decode-graph compile in the measurement), after one
unreported run of each configuration.
Configurations are interleaved, a different one first each repeat; the table gives medians over --repeats.

    flock /tmp/cpu.lock .venv/bin/python bench/long_prefill.py --repeats 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import medians, provenance, rotated, write  # noqa: E402

from ragserve_engine.llm import LLM  # noqa: E402
from ragserve_engine.sampling_params import SamplingParams  # noqa: E402

CONFIGS = {  # name: (--long-prefill-token-threshold, --max-long-partial-prefills)
    "no cap": (0, 0),
    "cap, all long prompts share": (256, 0),
    "cap, one long prompt at a time": (256, 1),
}
KEYS = ("long_first_s", "long_mean_s", "long_last_s", "short_mean_s", "short_max_s", "makespan_s")


def workload(args, vocab: int, seed: int) -> list[tuple[float, str, list[int], int]]:
    """(arrival s, id, prompt, max_tokens), in arrival order."""
    rng = random.Random(seed)
    prompt = lambda n: [rng.randrange(100, vocab) for _ in range(n)]  # noqa: E731
    out = [(0.0, f"long-{i}", prompt(args.long_tokens), 16) for i in range(args.long)]
    t = 0.5
    while t < args.long * args.long_tokens / args.prefill_rate:
        out.append((t, f"short-{len(out)}", prompt(args.short_tokens), 8))
        t += args.short_every
    return out


def run(model, args, cap: int, limit: int, seed: int) -> dict:
    llm = LLM(args.model, loaded_model=model, num_gpu_blocks=args.num_blocks, enforce_eager=True,
              long_prefill_token_threshold=cap, max_long_partial_prefills=limit)  # fmt: skip
    engine = llm.engine
    pending = workload(args, engine.tokenizer.vocab_size, seed)
    arrival = {rid: t for t, rid, _, _ in pending}
    first: dict[str, float] = {}
    t0 = time.monotonic()
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - t0
        while pending and pending[0][0] <= now:
            _, rid, prompt, max_tokens = pending.pop(0)
            engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        for out in engine.step():
            if out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = time.monotonic() - t0 - arrival[out.request_id]
    makespan = time.monotonic() - t0
    long = sorted(v for k, v in first.items() if k.startswith("long"))
    short = [v for k, v in first.items() if k.startswith("short")]
    return {
        "long_first_s": long[0], "long_mean_s": statistics.mean(long), "long_last_s": long[-1],
        "short_mean_s": statistics.mean(short), "short_max_s": max(short), "makespan_s": makespan,
        "shorts": len(short), "ttft": first,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--long", type=int, default=4, help="cold long prompts arriving together")
    parser.add_argument("--long-tokens", type=int, default=1200)
    parser.add_argument("--short-tokens", type=int, default=48)
    parser.add_argument("--short-every", type=float, default=2.0)
    parser.add_argument("--prefill-rate", type=float, default=250.0, help="tokens/s, to size the short arrivals")
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--name", default="long_prefill")
    args = parser.parse_args()
    model = LLM(args.model, enforce_eager=True).engine.runner.model
    for cap, limit in CONFIGS.values():  # each configuration's chunk shapes once, not reported
        run(model, args, cap, limit, seed=99)
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for rep in range(args.repeats):
        for name in rotated(list(CONFIGS), rep):
            runs[name].append(run(model, args, *CONFIGS[name], seed=rep))
            print(name, {k: round(runs[name][-1][k], 2) for k in KEYS}, flush=True)
    table = {name: medians(r, KEYS) for name, r in runs.items()}
    lines = [
        "# A burst of cold long prompts beside short ones: TTFT by per-step prefill cap",
        "",
        f"Command: `{provenance('long_prefill.py')['command']}` at {provenance('long_prefill.py')['commit']}, "
        f"{provenance('long_prefill.py')['date']}.",
        "",
        f"{args.long} cold prompts of {args.long_tokens} tokens at t = 0, a {args.short_tokens}-token prompt every "
        f"{args.short_every} s from 0.5 s; smollm2-135m, float32, eager, one engine on this machine's CPU. Medians of "
        f"{args.repeats} interleaved repeats, seconds.",
        "",
        "| engine | long TTFT first / mean / last | short TTFT mean / max | all done |",
        "|---|---|---|---:|",
    ]
    for name, m in table.items():
        cap, limit = CONFIGS[name]
        flags = f" (`--long-prefill-token-threshold {cap} --max-long-partial-prefills {limit}`)" if cap else ""
        lines.append(
            f"| {name}{flags} | {m['long_first_s']:.2f} / {m['long_mean_s']:.2f} / {m['long_last_s']:.2f} | "
            f"{m['short_mean_s']:.2f} / {m['short_max_s']:.2f} | {m['makespan_s']:.1f} |"
        )
    report = {**provenance("long_prefill.py"), "args": vars(args), "medians": table, "runs": runs}
    write(args.out, args.name, report, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
