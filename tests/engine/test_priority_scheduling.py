"""--scheduling-policy priority on a tiny model: a waiting request of higher priority than the running ones is
admitted at once, preempting the lowest-priority running request when no seat is free, and its prefill runs in a
step of its own (the lower-priority requests skip that one step); every request's greedy output is the same as in
a plain batch, the preempted one's included (it resumes by recompute or from swap)."""

from __future__ import annotations

import pytest

from ragserve_engine.sampling_params import SamplingParams
from tests.engine.test_engine_behaviour import assert_pool_consistent, fresh, llm  # noqa: F401 - the fixture

LOW = [list(range(200 + 30 * i, 230 + 30 * i)) for i in range(2)]
URGENT = list(range(900, 940))
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(("seats", "mode"), [(2, "recompute"), (2, "swap"), (4, "recompute")])
def test_an_urgent_request_is_admitted_at_once_and_prefills_alone(llm, seats, mode):  # noqa: F811
    alone = {i: o.outputs[0].token_ids for i, o in enumerate(fresh(llm).generate([*LOW, URGENT], PARAMS))}
    engine = fresh(llm, max_num_seqs=seats, scheduling_policy="priority", preemption_mode=mode,
                   swap_space=0.01).engine  # fmt: skip
    for i, prompt in enumerate(LOW):
        engine.add_request(f"low-{i}", prompt, PARAMS)
    for _ in range(3):  # both prefilled and decoding
        engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["low-0", "low-1"]
    engine.add_request("urgent", URGENT, PARAMS, priority=-1)
    stepped = [o.request_id for o in engine.step()]
    assert stepped == ["urgent"], "the urgent prefill ran with lower-priority work"
    assert "urgent" in [r.request_id for r in engine.scheduler.running]
    assert engine.scheduler.num_preemptions == (1 if seats == 2 else 0)  # no free seat: the latest low one goes
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done == {"low-0": alone[0], "low-1": alone[1], "urgent": alone[2]}
    assert_pool_consistent(engine)


def test_fcfs_keeps_the_running_batch(llm):  # noqa: F811
    """The default policy: a request with a lower priority value waits for a seat like any other."""
    engine = fresh(llm, max_num_seqs=2).engine
    for i, prompt in enumerate(LOW):
        engine.add_request(f"low-{i}", prompt, PARAMS)
    for _ in range(3):
        engine.step()
    engine.add_request("urgent", URGENT, PARAMS, priority=-1)
    assert sorted(o.request_id for o in engine.step()) == ["low-0", "low-1"]
    assert engine.scheduler.num_preemptions == 0
