"""Prefix hashes resumed from kept points (ragserve/prefix_hashes.py) are keys.block_hashes' exactly."""

from __future__ import annotations

import random
import threading
from array import array

import pytest

from ragserve.keys import block_hashes, root_hash
from ragserve.prefix_hashes import STRIDE, PrefixHashes

ROOTS = [root_hash("model-a"), root_hash("model-b")]


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(50_000) for _ in range(n)]


def test_prompts_sharing_prefixes_hash_as_block_hashes_does():
    """RAG-like prompts (contexts + questions), chat turns that extend each other, the same tokens under other
    salts, roots and block sizes, and prompts around the kept points' boundaries, in random order."""
    rng = random.Random(7)
    contexts = [tokens(rng, rng.randrange(300, 3000)) for _ in range(4)]
    prompts = []
    for _ in range(60):
        ctx = rng.choice(contexts)
        prompts.append(ctx + tokens(rng, rng.randrange(0, 80)))
        prompts.append(ctx[: rng.randrange(len(ctx))])
    turn = tokens(rng, 200)
    for _ in range(10):
        turn = turn + tokens(rng, rng.randrange(30, 300))
        prompts.append(turn)
    for bs in (16, 7):
        base = contexts[0][: STRIDE * bs * 2]
        prompts += [base[: STRIDE * bs * k + d] for k in (1, 2) for d in (-1, 0, 1)]
    rng.shuffle(prompts)
    hashes = PrefixHashes(capacity_blocks=40 * STRIDE)  # small: points are evicted as it goes
    for prompt in prompts:
        for bs in (16, 7):
            for root in ROOTS:
                for salt in (None, "tenant-1", "tenant-2"):
                    assert hashes(prompt, bs, root, salt) == block_hashes(prompt, bs, root, salt)
        ids = array("I", prompt)  # the router's ids: packed as they are
        assert hashes(ids, 16, ROOTS[0]) == block_hashes(ids, 16, ROOTS[0]) == block_hashes(prompt, 16, ROOTS[0])
    assert hashes.hits > 30 and hashes.misses > 10  # resumed often, and evicted
    assert hashes.blocks <= 40 * STRIDE


def test_a_prompt_resumes_from_its_longest_kept_point():
    rng = random.Random(1)
    context = tokens(rng, 16 * STRIDE * 5 + 3)  # five kept points
    hashes = PrefixHashes()
    hashes(context + tokens(rng, 40), 16, ROOTS[0])
    assert (hashes.hits, hashes.misses, hashes.blocks) == (0, 1, 5 * STRIDE)
    got = hashes(context + tokens(rng, 40), 16, ROOTS[0])
    assert got == block_hashes(context, 16, ROOTS[0]) + got[len(context) // 16 :]
    assert (hashes.hits, hashes.misses) == (1, 1)
    hashes(context, 16, ROOTS[0], "salted")  # the salt is in every point's digest: no resume
    hashes(context, 8, ROOTS[0])
    hashes(context, 16, ROOTS[1])
    assert (hashes.hits, hashes.misses) == (1, 4)
    halves = PrefixHashes()  # 8-token blocks' points fall where 16-token blocks' do, every other one
    halves(context, 8, ROOTS[0])
    assert halves(context, 16, ROOTS[0]) == block_hashes(context, 16, ROOTS[0])
    short = context[: 16 * STRIDE - 1]  # under one kept point: hashed as it is, nothing kept
    assert hashes(short, 16, ROOTS[0]) == block_hashes(short, 16, ROOTS[0])
    assert (hashes.hits, hashes.misses) == (1, 4)


def test_the_least_recently_used_points_go_first():
    rng = random.Random(2)
    a, b, c = (tokens(rng, 16 * STRIDE * 2) for _ in range(3))
    hashes = PrefixHashes(capacity_blocks=4 * STRIDE)
    hashes(a, 16, ROOTS[0])
    hashes(b, 16, ROOTS[0])
    hashes(a, 16, ROOTS[0])  # a's points are the newest now
    hashes(c, 16, ROOTS[0])  # b's go
    assert hashes.blocks == 4 * STRIDE
    hits = hashes.hits
    hashes(a, 16, ROOTS[0])
    assert hashes.hits == hits + 1
    hashes(b, 16, ROOTS[0])
    assert hashes.hits == hits + 1


@pytest.mark.parametrize(
    ("ids", "block_size", "root"),
    [([2**32] * 400, 16, ROOTS[0]), ([-1] * 400, 16, ROOTS[0]), ([1] * 400, 0, ROOTS[0]), ([1] * 400, 16, b"x")],
)
def test_bad_input_is_the_same_value_error_as_block_hashes(ids, block_size, root):
    with pytest.raises(ValueError):
        block_hashes(ids, block_size, root)
    with pytest.raises(ValueError):
        PrefixHashes()(ids, block_size, root)


def test_threads_hash_one_cache_correctly():
    rng = random.Random(3)
    context = tokens(rng, 3000)
    prompts = [context + tokens(rng, k) for k in range(40)]
    want = [block_hashes(p, 16, ROOTS[0]) for p in prompts]
    hashes, wrong = PrefixHashes(capacity_blocks=8 * STRIDE), []

    def work(seed: int) -> None:
        order = random.Random(seed).sample(range(len(prompts)), len(prompts))
        wrong.extend(i for i in order if hashes(prompts[i], 16, ROOTS[0]) != want[i])

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong
