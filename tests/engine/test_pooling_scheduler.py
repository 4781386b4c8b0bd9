"""The pooling scheduler's step: oldest inputs first, while the padded batch fits the token budget and the
sequence cap; at least one input per step; aborted inputs are dropped."""

from __future__ import annotations

from ragserve_engine.pooling.scheduler import PoolingScheduler, PoolingSequence


def seqs(lengths: list[int], request_id: str = "r") -> list[PoolingSequence]:
    return [PoolingSequence(request_id, list(range(n)), lambda v, e: None) for n in lengths]


def test_a_step_takes_inputs_in_order_while_the_padded_batch_fits():
    s = PoolingScheduler(max_num_seqs=8, max_num_batched_tokens=100)
    s.add(seqs([10, 30, 20, 40, 5]))
    assert [len(x.token_ids) for x in s.schedule()] == [10, 30, 20]  # 3 x 30 = 90; a 4th would pad to 4 x 40
    assert s.waiting_tokens == 45
    assert [len(x.token_ids) for x in s.schedule()] == [40, 5]
    assert s.schedule() == [] and s.waiting_tokens == 0


def test_an_input_over_the_budget_runs_alone_and_the_cap_holds():
    s = PoolingScheduler(max_num_seqs=2, max_num_batched_tokens=16)
    s.add(seqs([64, 1, 1, 1]))
    assert [len(x.token_ids) for x in s.schedule()] == [64]
    assert len(s.schedule()) == 2 and len(s.schedule()) == 1


def test_aborted_inputs_are_dropped():
    s = PoolingScheduler(max_num_seqs=8, max_num_batched_tokens=1000)
    s.add(seqs([3, 3], "gone") + seqs([4], "kept"))
    s.abort("gone")
    assert [x.request_id for x in s.schedule()] == ["kept"]
    assert not s.has_waiting()
