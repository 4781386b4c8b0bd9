"""slots.leading_match / common_prefix: the leading blocks two prompts share, found by halving in C-compared slices,
equal a block-by-block count (equal hashes that are different objects count too)."""

from __future__ import annotations

import os
import random

from ragserve_router.slots import common_prefix, leading_match


def naive(a: list[bytes], b: list[bytes]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


def test_common_prefix_equals_a_block_by_block_count():
    rng = random.Random(11)
    pool = [os.urandom(32) for _ in range(400)]
    for _ in range(3000):
        a = [rng.choice(pool) for _ in range(rng.randrange(0, 300))]
        cut = rng.randrange(0, len(a) + 1)
        b = [bytes(h) if rng.random() < 0.3 else h for h in a[:cut]]  # equal hashes, sometimes new objects
        b += [rng.choice(pool) for _ in range(rng.randrange(0, 300))]
        assert common_prefix(tuple(a), tuple(b)) == naive(a, b) == common_prefix(tuple(b), tuple(a))


def test_leading_match_is_the_best_prompt():
    hs = [os.urandom(32) for _ in range(50)]
    prompts = [(*hs[:10], b"x" * 32), tuple(hs[:30]), tuple(hs[:5]), ()]
    assert leading_match(hs, prompts) == 30
    assert leading_match(hs, []) == 0
    assert leading_match([], prompts) == 0
