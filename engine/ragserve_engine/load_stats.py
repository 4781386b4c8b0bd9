"""LoadTracker: the engine's measured speeds and queued work, for the router's cost model.

Updated on the step thread after every step; read from any thread (plain numbers). Speeds are
exponentially weighted over recent steps:

- decode step time as a line over the decode batch, `step_s = a + b * num_decoding`, fitted on
  decode-only steps (so `a` is also the fixed cost every step pays) and on the decode share of
  mixed steps: an engine that is never without prefill work (a queue of cold prompts) keeps its
  decode estimate current instead of reporting the speed it had when idle;
- prefill throughput: prefill tokens over the time a step spent beyond its decode share.

Decode-only steps through a compiled decode graph are fitted apart from eager ones (start-up calibration,
mixed steps, sizes still compiling): once a graph has timed a step the engine reports the graph line, so a
figure is never a blend of the two paths, and `decode_path` tells the router which one it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from ragserve_engine.scheduler_output import ScheduledSeq, SchedulerOutput

DECAY = 0.9  # weight of the past per observed step
MIN_X_VARIANCE = 0.25  # batch-size variance (std 0.5) the recent decode steps need before a slope is fitted
MIN_BASE_SHARE = 0.1  # of the mean decode step: the least the line gives at any batch
MIN_PREFILL_SAMPLE = 16  # tokens; smaller prefill chunks say more about overhead than throughput
# decode_path values (the heartbeat's DecodePath, proto/ragserve/v1/registry.proto, lower-cased)
UNMEASURED, EAGER, EAGER_BEFORE_GRAPHS, GRAPH = "unmeasured", "eager", "eager_before_graphs", "graph"


def is_decode(s: ScheduledSeq) -> bool:
    seq = s.seq
    return s.num_new_tokens == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens


@dataclass
class _Ewma:
    """Exponentially weighted sums for a least-squares line y = a + b * x."""

    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0

    fit: float = 0.0  # the slope of the last window whose x varied enough to fit one
    fitted: bool = False  # some window did (fit 0.0 is then a measurement)

    def add(self, x: float, y: float) -> None:
        self.w, self.x, self.y = DECAY * self.w + 1, DECAY * self.x + x, DECAY * self.y + y
        self.xx, self.xy = DECAY * self.xx + x * x, DECAY * self.xy + x * y
        var = self.w * self.xx - self.x * self.x
        if var > MIN_X_VARIANCE * self.w * self.w:
            self.fit = max(0.0, (self.w * self.xy - self.x * self.y) / var)
            self.fitted = True

    def slope(self) -> float:
        """Kept while recent steps all had one batch size: their noise would fit any slope at all."""
        return self.fit

    def at(self, x: float) -> float:
        """The line at batch x; never under MIN_BASE_SHARE of the mean step, as a step's fixed cost (its weights
        read once) is not: a noisy fit (a step slowed by another process) may cross zero near batch 0."""
        if self.w == 0:
            return 0.0
        mean_x, mean_y = self.x / self.w, self.y / self.w
        return max(MIN_BASE_SHARE * mean_y, mean_y + self.slope() * (x - mean_x))


@dataclass
class LoadTracker:
    step_token_budget: int
    queued_prefill_tokens: int = 0  # snapshot after the last step
    computed_prompt_tokens: int = 0  # cumulative
    num_decoding: int = 0
    untimed_steps: int = 0  # steps that compiled or ran beside a compile: left out of the speeds
    _eager: _Ewma = None  # type: ignore[assignment]  # eager decode steps and the decode share of mixed ones
    _graph: _Ewma = None  # type: ignore[assignment]  # decode steps through a compiled graph
    _prefill_tokens: float = 0.0
    _prefill_s: float = 0.0

    def __post_init__(self) -> None:
        self._eager, self._graph = _Ewma(), _Ewma()

    def observe(
        self, out: SchedulerOutput, seconds: float, queued_prefill_tokens: int, timed: bool = True, graph: bool = False
    ) -> None:
        """One executed step: its duration, what it computed, and the prefill work still queued after it.
        timed=False (the step compiled a graph): its duration is not a speed sample. graph: it ran through a
        compiled decode graph."""
        decodes = sum(1 for s in out.scheduled if is_decode(s))
        prefill = out.num_tokens - decodes
        self.computed_prompt_tokens += prefill
        self.untimed_steps += not timed
        if timed and prefill == 0:
            (self._graph if graph else self._eager).add(decodes, seconds)
        elif timed and prefill >= MIN_PREFILL_SAMPLE:  # a mixed step runs eager: its decode share is eager's
            decode_s = self._eager.at(decodes) if self._eager.w else 0.0
            if decodes and decode_s > 0 and self.prefill_tokens_per_s > 0:
                # split the step in the proportions the current estimates predict, so a machine that got
                # slower (or faster) moves both estimates instead of charging it all to prefill
                share = decode_s / (decode_s + prefill / self.prefill_tokens_per_s)
                self._eager.add(decodes, share * seconds)
                spent = (1 - share) * seconds
            else:
                spent = max(seconds - decode_s, 0.25 * seconds)
            self._prefill_tokens = DECAY * self._prefill_tokens + prefill
            self._prefill_s = DECAY * self._prefill_s + spent
        self.num_decoding = decodes
        self.queued_prefill_tokens = queued_prefill_tokens

    @property
    def prefill_tokens_per_s(self) -> float:
        return self._prefill_tokens / self._prefill_s if self._prefill_s > 0 else 0.0

    @property
    def _decode(self) -> _Ewma:
        """The line the engine reports: the graph's once a graph timed a step, else eager's."""
        return self._graph if self._graph.w else self._eager

    def decode_step_s(self, num_running: int) -> float:
        """Predicted duration of a step decoding num_running sequences (0 until measured)."""
        return self._decode.at(num_running)

    @property
    def decode_seq_s(self) -> float:
        """Step time each further decoding sequence adds (0 until the batch size has varied)."""
        return self._decode.slope()

    @property
    def decode_seq_measured(self) -> bool:
        return self._decode.fitted

    def decode_path(self, graphs: bool) -> str:
        """Which steps the reported decode line was timed on; graphs: the engine decodes through them."""
        if self._graph.w:
            return GRAPH
        if not self._eager.w:
            return UNMEASURED
        return EAGER_BEFORE_GRAPHS if graphs else EAGER
