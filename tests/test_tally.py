"""The engine's tally: every loop has its public counter, a gate's event reports the armed stretch
before it once, and a request keeps its acceptance by draft position."""

import pytest

from gmlx.request import Request, SamplingParams
from gmlx.spec.batch import Loop
from gmlx.spec.tally import NUM_EVENTS_REPORTED, STAT_KEYS, Tally


@pytest.mark.parametrize("loop", list(Loop))
def test_each_loop_counts_under_its_public_key(loop):
    tally = Tally()
    tally.count_round(loop)
    assert f"num_{loop.value}_rounds" in STAT_KEYS
    assert tally.counters[f"num_{loop.value}_rounds"] == tally.counters["num_rounds"] == 1
    assert tally.counters["num_spec_rounds"] == (1 if loop in (Loop.SCALAR, Loop.BATCH) else 0)


def test_the_armed_stretch_covers_the_rounds_since_arming_and_is_reported_once():
    tally = Tally()
    tally.count_round(Loop.SCALAR)
    tally.count_verify(4, 3)  # before arming: not the stretch's
    assert tally.take_armed_stretch() == {}
    tally.mark_armed()
    for num_drafted, num_accepted in [(3, 1), (2, 2)]:
        tally.count_round(Loop.BATCH)
        tally.count_verify(num_drafted, num_accepted)
    tally.count_round(Loop.GATED)
    assert tally.take_armed_stretch() == {"spec_rounds": 2, "drafted": 5, "accepted": 3}
    assert tally.take_armed_stretch() == {}  # the next gate without a new arming reports nothing


def test_the_snapshot_carries_the_acceptance_rate_and_only_the_latest_events():
    tally = Tally()
    assert tally.snapshot()["acceptance_rate"] is None  # nothing drafted yet
    tally.count_verify(8, 6)
    for i in range(NUM_EVENTS_REPORTED + 5):
        tally.event("admit", width=i % 3, num_new=i)
    snapshot = tally.snapshot()
    assert snapshot["acceptance_rate"] == pytest.approx(0.75)
    assert [e["num_new"] for e in snapshot["events"]] == list(range(5, NUM_EVENTS_REPORTED + 5))
    assert set(STAT_KEYS) <= set(snapshot)
    snapshot["num_drafted"] = 0  # a copy: the caller cannot reset the engine's counters
    assert tally.counters["num_drafted"] == 8


def test_a_request_counts_its_accepted_drafts_by_position():
    request = Request("r", [1, 2, 3], SamplingParams(), seed=0)
    request.count_verify(3, 2)
    request.count_verify(1, 0)
    request.count_verify(4, 4)
    assert (request.num_drafted, request.num_accepted) == (8, 6)
    assert request.accepted_by_position == [2, 2, 1, 1]
