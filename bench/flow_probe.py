"""Critical probes for bench/flow_fairness.py, from a process of their own.

    python bench/flow_probe.py URL N GAP_S

Sends N streaming critical requests (X-Ragserve-Priority: 1) one at a time, GAP_S apart, and prints their TTFTs
(seconds, a JSON list). In its own process the probe's clock is not held up by the load generator's event loop
(40 streaming clients parsing SSE), as a real critical client's would not be.
"""

from __future__ import annotations

import json
import sys
import time

import httpx
from flow_fairness import body


def probe(client: httpx.Client, url: str, i: int) -> float:
    headers = {"X-Ragserve-Priority": "1", "X-Tenant": "ops"}
    start = time.monotonic()
    with client.stream("POST", url + "/v1/completions", json=body(f"critical {i}", 4), headers=headers) as resp:
        if resp.status_code != 200:
            raise SystemExit(f"critical probe {i}: HTTP {resp.status_code}: {resp.read()!r}")
        ttft = None
        for line in resp.iter_lines():
            if ttft is None and line.startswith("data: {"):
                ttft = time.monotonic() - start
    if ttft is None:
        raise SystemExit(f"critical probe {i}: no token")
    return ttft


def main() -> None:
    url, n, gap = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    ttfts = []
    with httpx.Client(timeout=120) as client:
        for i in range(n):
            ttfts.append(probe(client, url, i))
            time.sleep(gap)
    print(json.dumps(ttfts))


if __name__ == "__main__":
    main()
