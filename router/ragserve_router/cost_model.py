"""kv_aware's cost model: each engine's predicted time to first token, in units of work.

For a prompt of P tokens and a candidate engine:

    local    = tokens its own prefix cache holds (exact KV index, else routing history), or will
               hold once a prompt this router sent it moments ago is prefilled
    fetched  = further tokens the cachestore holds, if the engine uses that store, or that the
               engine itself offloaded to CPU or disk (external engines' KV events), whichever is more
    computed = P - local - fetched                  (the last token is always computed)
    queued   = prefill tokens already waiting on it (its heartbeat, less what this router sent
               it that prefilled since, plus what it sent it since that heartbeat:
               pool.queued_prefill), in `prompts` prompts
    step     = step_time + seq_time x (decoding now - decoding at its heartbeat)
    TTFT     = (ahead + computed) / prefill_rate
               + steps x step
               + fetched / block_size x fetch_time

With no per-step prefill cap the queue is computed first: ahead = queued, steps = ceil((queued +
computed) / step budget). With the engine's --long-prefill-token-threshold cap C every prefill takes at
most C tokens a step, so the prompt shares steps with the queued ones instead of waiting for all of
them: steps = ceil(computed / C), and in each the others compute up to min(prompts x C, budget - C)
tokens: ahead = min(queued, steps x that). With --max-long-partial-prefills L as well, a prompt of at most
C tokens to compute shares its step with min(prompts, L) of them; a longer one waits for its turn behind
L or more queued prompts: ahead = queued, steps = ceil(queued / (L x C)) + ceil(computed / C).

prefill_rate, step_time (at the engine's decode batch when it reported), seq_time (what each
further decoding sequence adds to a step) and fetch_time (per block) are measured by each engine
and arrive with its heartbeat (offloaded blocks load at MEDIUM_LOAD_FRACTION of a block's prefill
instead of fetch_time); what an engine has not measured yet comes from the fleet's median,
else a default. "decoding now" is the router's view of the requests active on it.

Decode figures are compared like with like: the heartbeat says which steps they were timed on
(decode_path) and whether seq_time was fitted (decode_seq_measured: a fitted 0 is taken as 0). An
engine that has only timed eager steps but will decode through compiled graphs (its start-up
calibration, DECODE_EAGER_BEFORE_GRAPHS) takes the median of the peers that timed graph steps, if any,
rather than being ranked on a slower path than theirs.

Engines are ranked by cost = TTFT + work_weight x computed / prefill_rate (the cluster capacity the
request uses: what a cache hit saves) + decode, where decode = output tokens x (step + seq_time x
(1 + decoding now)): its own decode steps and the slowdown it imposes on the sequences already there. An engine
whose free KV blocks cannot hold the prompt and output (kv_room) ranks after every engine that can: it would
preempt. The free count leaves out blocks in use, so the leading blocks a request this router sent there and
that has not ended holds (pool.held_blocks) are not needed again: a hot document's next request fits beside the
ones sharing it. The free count is the heartbeat's: the requests this router sent there after it will take blocks
too (their prompt tokens to compute or fetch, which leave out what the engine or an earlier one of them holds,
plus their output: pool.pending_blocks), so a burst does not send more than fits. For a decode engine of a disaggregated
request the decode term and KV room are what set it apart.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from operator import is_
from typing import NamedTuple

from ragserve.keys import cacheable_blocks
from ragserve.v1 import registry_pb2
from ragserve_router.engines import Load

DEFAULT_PREFILL_TOKENS_PER_S = 1000.0
DEFAULT_STEP_S = 0.04
DEFAULT_SEQ_S = 0.006
DEFAULT_OUTPUT_TOKENS = 128  # requests without max_tokens
DEFAULT_STEP_TOKEN_BUDGET = 2048
DEFAULT_FETCH_FRACTION = 0.5  # a block's fetch cost relative to prefilling it, until an engine measured one
# Loading a block an engine offloaded (vLLM's KV events say which medium holds it) relative to prefilling it:
# dearer than a GPU-resident block (0), cheaper than recomputing (1); media not listed cost DEFAULT_FETCH_FRACTION.
MEDIUM_LOAD_FRACTION = {"CPU": 0.1, "DISK": 0.3}


@dataclass(frozen=True)
class Speed:
    prefill_tokens_per_s: float
    step_s: float  # at `batch` decoding sequences
    seq_s: float
    batch: int
    fetch_s_per_block: float
    step_token_budget: int
    prefill_cap: int = 0  # --long-prefill-token-threshold (0: none)
    long_prefills: int = 0  # --max-long-partial-prefills with the cap (0: any number)

    def step_at(self, decoding: float) -> float:
        return self.step_s + self.seq_s * max(0.0, decoding - self.batch)


@dataclass(frozen=True)
class PeerFigures:
    """Decode figures of one group of peers: median step (None: none measured) and fitted slope (None: none)."""

    step_s: float | None
    seq_s: float | None
    size: int

    @classmethod
    def of(cls, loads: Sequence[Load]) -> PeerFigures:
        steps = [f.decode_step_s for f in loads if f.decode_step_s > 0]
        slopes = [f.decode_seq_s for f in loads if f.decode_seq_measured]
        return cls(
            statistics.median(steps) if steps else None, statistics.median(slopes) if slopes else None, len(loads)
        )


@dataclass(frozen=True)
class FleetFigures:
    """What calibrate() takes from the fleet, computed once per decision rather than once per engine (it is
    O(fleet)): medians of the measured prefill and fetch speeds, and of the decode figures of the peers timed
    on graph steps, on other steps, and on any."""

    prefill_tokens_per_s: float | None
    fetch_s_per_block: float | None
    graph: PeerFigures
    other: PeerFigures
    measured: PeerFigures

    @classmethod
    def of(cls, fleet: Sequence[Load]) -> FleetFigures:
        unmeasured, graph = registry_pb2.DECODE_UNMEASURED, registry_pb2.DECODE_GRAPH
        rates = [f.prefill_tokens_per_s for f in fleet if f.prefill_tokens_per_s > 0]
        fetches = [f.fetch_s_per_block for f in fleet if f.fetch_s_per_block > 0]
        measured = [f for f in fleet if f.decode_path != unmeasured]
        return cls(
            statistics.median(rates) if rates else None,
            statistics.median(fetches) if fetches else None,
            PeerFigures.of([f for f in measured if f.decode_path == graph]),
            PeerFigures.of([f for f in measured if f.decode_path != graph]),
            PeerFigures.of(measured),
        )


def _decode_figures(load: Load, fleet: FleetFigures) -> tuple[float, float | None, int]:
    """(step_s, seq_s or None when no slope is known, batch the step was reported at): the engine's own
    figures, what it lacks from the peers timed on the same path; an unmeasured or provisional engine takes
    the graph peers' median, else every measured peer's."""
    unmeasured, graph = registry_pb2.DECODE_UNMEASURED, registry_pb2.DECODE_GRAPH
    provisional = load.decode_path == registry_pb2.DECODE_EAGER_BEFORE_GRAPHS and fleet.graph.size
    own = load.decode_path != unmeasured and not provisional
    if own:  # like with like: eager with eager, graph with graph
        peers = fleet.graph if load.decode_path == graph else fleet.other
    else:
        peers = fleet.graph if fleet.graph.size else fleet.measured
    step = load.decode_step_s if own else (peers.step_s if peers.step_s is not None else DEFAULT_STEP_S)
    seq = load.decode_seq_s if own and load.decode_seq_measured else peers.seq_s
    return step, seq, load.num_running if own else 0


def calibrate(load: Load, fleet: FleetFigures | Sequence[Load], block_size: int) -> Speed:
    """The engine's own measurements; what it has not measured yet comes from the fleet (its loads, or their
    FleetFigures), else defaults."""
    if not isinstance(fleet, FleetFigures):
        fleet = FleetFigures.of(fleet)
    rate = load.prefill_tokens_per_s or fleet.prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S
    step, seq, batch = _decode_figures(load, fleet)
    if seq is None:  # no batch-size slope fitted here or on the peers: the default's share of the step
        seq = DEFAULT_SEQ_S * step / DEFAULT_STEP_S
    fetch = load.fetch_s_per_block or fleet.fetch_s_per_block or DEFAULT_FETCH_FRACTION * max(block_size, 1) / rate
    budget = load.step_token_budget or DEFAULT_STEP_TOKEN_BUDGET
    return Speed(
        rate, step, seq, batch, fetch, budget, load.long_prefill_token_threshold, load.max_long_partial_prefills
    )


class FleetSpeeds:
    """calibrate() of each engine of a candidate set, kept until one of their loads is replaced (a heartbeat; a Load
    never changes) rather than worked out on every decision: per set of engine ids, their loads and Speeds."""

    MAX_SETS = 64  # candidate sets kept (all of them forgotten past that)

    def __init__(self) -> None:
        self._sets: dict[tuple[tuple[str, ...], int], tuple[tuple[Load, ...], tuple[Speed, ...]]] = {}

    def of(self, engine_ids: tuple[str, ...], loads: Sequence[Load], block_size: int) -> tuple[Speed, ...]:
        """Each load's Speed, in their order: calibrate(load, loads, block_size)."""
        key = (engine_ids, block_size)
        kept = self._sets.get(key)
        if kept is not None and len(kept[0]) == len(loads) and all(map(is_, kept[0], loads)):
            return kept[1]
        fleet = FleetFigures.of(loads)
        speeds = tuple(calibrate(load, fleet, block_size) for load in loads)
        if len(self._sets) >= self.MAX_SETS:
            self._sets.clear()
        self._sets[key] = (tuple(loads), speeds)
        return speeds


class Prediction(NamedTuple):  # a tuple: made for every candidate of every decision, and cheaper so
    local_tokens: int
    fetched_tokens: int
    computed_tokens: int
    queued_tokens: int
    ttft_s: float
    cost: float  # what engines are ranked by


def predict(
    num_prompt_tokens: int,
    block_size: int,
    local_blocks: int,
    store_blocks: int,
    queued_tokens: int,
    decoding: float,
    output_tokens: int,
    speed: Speed,
    work_weight: float,
    queued_prompts: int = 1,
) -> Prediction:
    cacheable = cacheable_blocks(num_prompt_tokens, block_size) * block_size if block_size else 0
    local = min(local_blocks * block_size, cacheable)
    fetched = max(0, min(store_blocks * block_size, cacheable) - local)
    computed = num_prompt_tokens - local - fetched
    ahead, steps = prefill_ahead(computed, queued_tokens, queued_prompts, speed)
    work = ahead + computed
    step = speed.step_at(decoding)
    fetch_s = fetched / block_size * speed.fetch_s_per_block if fetched else 0.0
    ttft = work / speed.prefill_tokens_per_s + steps * step + fetch_s
    decode = output_tokens * (step + speed.seq_s * (1 + decoding))
    cost = ttft + work_weight * computed / speed.prefill_tokens_per_s + decode
    return Prediction(local, fetched, computed, queued_tokens, ttft, cost)


def prefill_ahead(computed: int, queued: int, prompts: int, speed: Speed) -> tuple[int, int]:
    """(queued tokens computed before this prompt's first token, steps until then)."""
    budget, cap, limit = speed.step_token_budget, speed.prefill_cap, speed.long_prefills
    if not cap or cap >= budget:
        return queued, max(1, math.ceil((queued + computed) / budget))
    steps = max(1, math.ceil(computed / cap))
    if limit and computed > cap and prompts >= limit:  # a long prompt waits for a long prefill's turn
        return queued, math.ceil(queued / (limit * cap)) + steps
    sharing = min(max(1, prompts), limit) if limit else max(1, prompts)
    per_step = min(sharing * cap, budget - min(cap, computed))
    return min(queued, steps * per_step), steps


def offload_speed(speed: Speed, medium: str, block_size: int) -> Speed:
    """The engine's speed with its fetch figure replaced by loading one block from `medium`."""
    fraction = MEDIUM_LOAD_FRACTION.get(medium.upper(), DEFAULT_FETCH_FRACTION)
    return replace(speed, fetch_s_per_block=fraction * max(block_size, 1) / speed.prefill_tokens_per_s)


def kv_room(
    load: Load, tokens: int, block_tokens: int, held_tokens: int = 0, pending: Callable[[], int] = lambda: 0
) -> bool:
    """Whether the engine's free KV blocks (its last heartbeat) hold a request of `tokens` prompt + output tokens,
    less its leading `held_tokens` that requests running there hold already (in use: not in the free count, and
    shared rather than taken anew), beside the `pending()` blocks our requests sent since that heartbeat take
    (asked only when the free count alone holds the request); an engine that reported no block counts has room."""
    if not load.total_blocks:
        return True
    spare = load.free_blocks - (-(-tokens // block_tokens) - held_tokens // block_tokens)
    return spare >= 0 and pending() <= spare


def output_tokens(body: dict) -> int:
    """Tokens the request may generate: its max_tokens (or max_completion_tokens), else a default."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return DEFAULT_OUTPUT_TOKENS
