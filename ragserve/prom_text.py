"""Prometheus text exposition (format 0.0.4), read without prometheus_client: samples, declared types, and
an engine's load. Torch-free, standard library only; shared by the router, the operator and the chart tests.

KV usage, defined once: `vllm:kv_cache_usage_perc` is the fraction of one engine process's KV-block pool in
use. An engine exports it once per served model (`model_name` label), every series describing the same
pool, so a pod's KV usage is the HIGHEST of its series: summing would count the pool once per model and
exceed 1. Request gauges are summed (each served model's queue is separate work). See
ragserve.metric_names.LOAD_METRICS.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from ragserve.metric_names import LOAD_METRICS

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_QUOTED = r'"(?:[^"\\]|\\.)*"'
_SAMPLE = re.compile(rf"({_NAME})\s*(\{{(?:[^\"}}]|{_QUOTED})*\}})?\s+(\S+)(?:\s+-?\d+)?\s*")
_LABEL = re.compile(rf"\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*({_QUOTED})\s*(,|$)")
_TYPE = re.compile(rf"#\s*TYPE\s+({_NAME})\s+(\w+)\s*")
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str] = field(hash=False)
    value: float


def _labels(block: str | None, line: str) -> dict[str, str]:
    inner, labels, pos = (block or "{}")[1:-1], {}, 0
    while inner[pos:].strip():
        match = _LABEL.match(inner, pos)
        if not match:
            raise ValueError(f"malformed labels in metrics line {line!r}")
        labels[match.group(1)] = re.sub(r"\\.", lambda m: _ESCAPES.get(m.group(0), m.group(0)), match.group(2)[1:-1])
        pos = match.end()
    return labels


def samples(text: str) -> Iterator[Sample]:
    """Every sample; ValueError on a line that is neither a sample, a comment nor blank."""
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = _SAMPLE.fullmatch(line.strip())
        if not match:
            raise ValueError(f"malformed metrics line {line!r}")
        try:
            value = float(match.group(3))
        except ValueError:
            raise ValueError(f"malformed value in metrics line {line!r}") from None
        yield Sample(match.group(1), _labels(match.group(2), line), value)


def metric_types(text: str) -> dict[str, str]:
    """Family name -> declared type (counter, gauge, histogram, summary, untyped), from `# TYPE` lines.
    Counters are named without `_total`, the way they are declared in code."""
    out = {}
    for line in text.splitlines():
        if match := _TYPE.fullmatch(line.strip()):
            name, kind = match.groups()
            out[name.removesuffix("_total") if kind == "counter" else name] = kind
    return out


def values(text: str, names: set[str]) -> dict[str, list[float]]:
    """name -> the value of each of its series (label sets), for the names asked for that are present."""
    found: dict[str, list[float]] = {}
    for sample in samples(text):
        if sample.name in names:
            found.setdefault(sample.name, []).append(sample.value)
    return found


@dataclass(frozen=True)
class EngineLoad:
    """One engine pod's load, read from its /metrics (ragserve.metric_names.LOAD_METRICS)."""

    waiting: float  # vllm:num_requests_waiting, summed over served models
    running: float  # vllm:num_requests_running, summed over served models
    kv_usage: float  # vllm:kv_cache_usage_perc, 0..1, the highest series (see the module docstring)
    queued_prefill_tokens: float  # ragserve:num_queued_prefill_tokens, summed over served models


_REDUCE = {"sum": sum, "max": max}


def engine_load(text: str, required: bool = True) -> EngineLoad:
    """The load in an engine's exposition. A missing metric is ValueError naming it, or 0 if not `required`."""
    found = values(text, {n for m in LOAD_METRICS for n in (m.name, *m.aliases)})
    out, missing = {}, []
    for metric in LOAD_METRICS:
        series = next((found[n] for n in (metric.name, *metric.aliases) if n in found), None)
        if series is None and metric.required:
            missing.append(metric.name)
        out[metric.field] = float(_REDUCE[metric.per_pod](series)) if series else 0.0
    if missing and required:
        raise ValueError(f"metrics missing: {', '.join(missing)}")
    return EngineLoad(**out)
