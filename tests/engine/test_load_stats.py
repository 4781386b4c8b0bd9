"""LoadTracker: the speeds an engine reports for the router's cost model, from the steps it observed."""

from __future__ import annotations

import pytest

from ragserve_engine.load_stats import LoadTracker
from ragserve_engine.scheduler_output import ScheduledSeq, SchedulerOutput
from ragserve_engine.sequence import Sequence


def step(prefill: int, decodes: int) -> SchedulerOutput:
    """A step as observed after it ran (computed counts advanced): one prefill chunk and `decodes` decodes."""
    out = SchedulerOutput()
    if prefill:
        seq = Sequence(list(range(prefill + 50)), prefill + 50)
        seq.num_computed_tokens = prefill
        out.scheduled.append(ScheduledSeq(None, seq, prefill))
    for _ in range(decodes):
        seq = Sequence(list(range(11)), 10)
        seq.num_computed_tokens = 11
        out.scheduled.append(ScheduledSeq(None, seq, 1))
    return out


def test_decode_steps_fit_a_line_and_prefill_throughput_excludes_the_decode_share():
    load = LoadTracker(step_token_budget=2048)
    assert load.prefill_tokens_per_s == 0.0 and load.decode_step_s(4) == 0.0  # nothing measured yet
    for _ in range(5):
        load.observe(step(0, 2), 0.03, queued_prefill_tokens=0)  # 20 ms a step + 5 ms a sequence
        load.observe(step(0, 6), 0.05, queued_prefill_tokens=0)
    assert load.decode_step_s(4) == pytest.approx(0.04)
    assert load.decode_seq_s == pytest.approx(0.005)
    load.observe(step(1000, 2), 1.03, queued_prefill_tokens=700)  # 30 ms of it was the two decodes
    assert load.prefill_tokens_per_s == pytest.approx(1000.0)
    assert load.queued_prefill_tokens == 700 and load.computed_prompt_tokens == 1000
    load.observe(step(8, 2), 0.5, queued_prefill_tokens=0)  # a tiny chunk says nothing about throughput
    assert load.prefill_tokens_per_s == pytest.approx(1000.0) and load.computed_prompt_tokens == 1008


def test_an_engine_always_prefilling_keeps_its_decode_estimate_current():
    """Measured idle (20 ms steps), then only mixed steps at 5x the cost (a contended machine): the decode
    estimate moves with it (before, it stayed at the idle speed for as long as the queue lasted) and the
    two estimates together predict the slower steps."""
    load = LoadTracker(step_token_budget=2048)
    for _ in range(5):
        load.observe(step(0, 2), 0.03, queued_prefill_tokens=0)
        load.observe(step(0, 6), 0.05, queued_prefill_tokens=0)
    load.observe(step(1000, 2), 1.03, queued_prefill_tokens=5000)  # throughput 1,000 tokens/s
    assert load.decode_step_s(4) == pytest.approx(0.04)  # the mixed step agreed with the line
    for _ in range(40):  # everything 5x slower now, and never a decode-only step
        load.observe(step(1000, 4), 5 * (1.0 + 0.04), queued_prefill_tokens=5000)
    assert load.decode_step_s(4) > 2 * 0.04
    assert load.decode_step_s(4) + 1000 / load.prefill_tokens_per_s == pytest.approx(5 * 1.04, rel=0.02)


def test_a_step_that_compiled_is_not_a_speed_sample():
    load = LoadTracker(step_token_budget=2048)
    load.observe(step(0, 1), 9.0, queued_prefill_tokens=0, timed=False)  # the first decode compiled its graph
    load.observe(step(500, 0), 30.0, queued_prefill_tokens=0, timed=False)  # a prefill that compiled fused ops
    assert load.decode_step_s(1) == 0.0 and load.prefill_tokens_per_s == 0.0  # still unmeasured
    assert load.untimed_steps == 2 and load.computed_prompt_tokens == 500
    load.observe(step(0, 1), 0.02, queued_prefill_tokens=0)
    assert load.decode_step_s(1) == pytest.approx(0.02)


def test_steps_at_one_batch_size_keep_the_fitted_slope():
    """Fitted over batches 2 and 6, then only batch 1 (a single user) while the machine gets slower: those
    steps cannot fit a slope (before, the line through them and the faded old samples tipped to 0), so the
    per-sequence cost stays the last fitted one while the step time follows the machine."""
    load = LoadTracker(step_token_budget=2048)
    for _ in range(5):
        load.observe(step(0, 2), 0.03, queued_prefill_tokens=0)
        load.observe(step(0, 6), 0.05, queued_prefill_tokens=0)
    for i in range(80):
        load.observe(step(0, 1), 0.025 if i < 40 else 0.035, queued_prefill_tokens=0)
    assert load.decode_seq_s == pytest.approx(0.005, rel=0.1)
    assert load.decode_step_s(1) == pytest.approx(0.035, abs=0.002)


def test_graph_steps_are_fitted_apart_and_the_path_is_reported():
    """Eager calibration (20 ms + 5 ms a sequence), then compiled-graph steps (4 ms flat): the engine reports
    the graph's line alone, not a blend, and says which path and whether the slope was fitted (a fitted 0 is
    a measurement)."""
    load = LoadTracker(step_token_budget=2048)
    assert load.decode_path(graphs=True) == "unmeasured" and not load.decode_seq_measured
    load.observe(step(0, 2), 0.03, queued_prefill_tokens=0)
    assert load.decode_path(graphs=True) == "eager_before_graphs" and load.decode_path(graphs=False) == "eager"
    assert not load.decode_seq_measured  # one batch size: no slope yet
    for _ in range(4):
        load.observe(step(0, 6), 0.05, queued_prefill_tokens=0)
        load.observe(step(0, 2), 0.03, queued_prefill_tokens=0)
    assert load.decode_seq_measured and load.decode_seq_s == pytest.approx(0.005)
    load.observe(step(0, 1), 0.004, queued_prefill_tokens=0, graph=True)
    assert load.decode_path(graphs=True) == "graph" and load.decode_step_s(1) == pytest.approx(0.004)
    assert not load.decode_seq_measured  # the graph line has one batch size so far
    for _ in range(4):
        load.observe(step(0, 4), 0.004, queued_prefill_tokens=0, graph=True)
        load.observe(step(0, 1), 0.004, queued_prefill_tokens=0, graph=True)
    assert load.decode_seq_measured and load.decode_seq_s == 0.0  # measured flat
    assert load.decode_step_s(4) == pytest.approx(0.004)


def test_a_noisy_window_leaves_the_decode_line_a_fixed_cost() -> None:
    """Calibration decodes at batch 3, then 1; batch-3 steps slowed by another process fitted a slope whose line
    went through zero at batch 0, and the engine reported a 0 s decode step (a CI failure at 4a438ec)."""
    load = LoadTracker(step_token_budget=2048)
    for _ in range(8):
        load.observe(step(0, 3), 0.120, queued_prefill_tokens=0)  # 30 ms a step at batch 1, 120 ms at 3: slowed
    for _ in range(8):
        load.observe(step(0, 1), 0.030, queued_prefill_tokens=0)
    assert load.decode_seq_measured and load.decode_step_s(0) >= 0.1 * 0.048  # a tenth of the mean step at least
    assert load.decode_step_s(1) == pytest.approx(0.030, rel=0.5)
