"""The raw-body depth check (ragserve.http.body.too_deep) agrees with the parsed JSON's nesting on any valid text:
strings full of quotes, backslashes and brackets do not count, and the bracket-count shortcut never hides depth."""

from __future__ import annotations

import json
import random

import pytest

from ragserve.http.body import parse_json_object, too_deep
from ragserve.http.errors import ApiError
from ragserve.http.limits import MAX_DEPTH

CHARS = '"\\[]{}an,: \n\u00e9'


def depth(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    return 0


def value(rng: random.Random, level: int):
    r = rng.random()
    if level > 7 or r < 0.35:
        return "".join(rng.choice(CHARS) for _ in range(rng.randrange(0, 12)))
    if r < 0.7:
        return [value(rng, level + 1) for _ in range(rng.randrange(0, 4))]
    return {value(rng, 99): value(rng, level + 1) for _ in range(rng.randrange(0, 4))}


def test_depth_of_valid_json_with_tricky_strings():
    rng = random.Random(5)
    for _ in range(3000):
        v = value(rng, 0)
        raw = json.dumps(v, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1])).encode()
        for limit in range(0, 9):
            assert too_deep(raw, limit) == (depth(v) > limit), (raw, limit)


def test_brackets_inside_strings_past_the_shortcut_do_not_count():
    raw = json.dumps({"model": "m", "prompt": '[{\\"' * 200 + "]" * 300}).encode()
    assert raw.count(b"[") > MAX_DEPTH and not too_deep(raw)
    assert parse_json_object(raw)["model"] == "m"


@pytest.mark.parametrize("levels", [MAX_DEPTH, MAX_DEPTH + 1])
def test_the_limit_is_inclusive(levels):
    raw = json.dumps({"x": json.loads("[" * (levels - 1) + "]" * (levels - 1))}).encode()
    if levels > MAX_DEPTH:
        with pytest.raises(ApiError, match="nested deeper"):
            parse_json_object(raw)
    else:
        assert parse_json_object(raw)["x"]
