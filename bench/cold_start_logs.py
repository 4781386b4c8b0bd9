"""Decode steps after /ready from the engine's own request log lines (cold_start.py's probes: per round, one
batch at each of 1/2/4/8): (e2e - ttft) / (tokens - 1) per request, the median per probe, steady = median of
the last 5 rounds, worst = slowest probe over steady.

    python bench/cold_start_logs.py /tmp/cold-start-*/after-0-warm.log ...
"""

from __future__ import annotations

import re
import statistics
import sys

SIZES, TOKENS, STEADY_ROUNDS = [1, 2, 4, 8], 48, 5
LINE = re.compile(rf"generation_tokens={TOKENS} ttft=([\d.]+)s e2e=([\d.]+)s")


def rounds(text: str) -> list[dict[int, float]]:
    steps = [(float(e) - float(t)) / (TOKENS - 1) * 1000 for t, e in LINE.findall(text)]
    out, i = [], 0
    while i + sum(SIZES) <= len(steps):  # each probe's requests finish before the next probe starts
        r = {}
        for b in SIZES:
            r[b], i = statistics.median(steps[i : i + b]), i + b
        out.append(r)
    return out


def main() -> None:
    for path in sys.argv[1:]:
        with open(path) as f:
            rs = rounds(f.read())
        steady = {b: statistics.median(r[b] for r in rs[-STEADY_ROUNDS:]) for b in SIZES}
        worst = max(r[b] / steady[b] for r in rs for b in SIZES)
        first = "/".join(f"{rs[0][b] / steady[b]:.2f}" for b in SIZES)
        ms = "/".join(f"{steady[b]:.1f}" for b in SIZES)
        print(f"| {path.rsplit('/', 1)[-1]} | {len(rs)} | {ms} | {first} | {worst:.2f} |")


if __name__ == "__main__":
    main()
