"""The prefill pacer's rules: the budget a step may spend on prefill, the plain round it keeps
timing under a long packed prefill, and what a packed chunk is charged."""

import pytest

from gmlx.spec.prefill_pacing import (
    APART_BUDGET_ROUNDS, PACKED_BUDGET_ROUNDS, PACKED_ROUNDS_PER_PLAIN, PACKING_MIN_WEIGHT_BYTES, PrefillPacer,
    is_packing_chosen)


@pytest.mark.parametrize("is_packed, rounds", [(True, PACKED_BUDGET_ROUNDS), (False, APART_BUDGET_ROUNDS)])
def test_the_auto_budget_is_a_share_of_the_plain_rounds_time(is_packed, rounds):
    pacer = PrefillPacer(is_packed, configured_budget_s=None)
    assert pacer.budget_s(is_decoding=True) is None  # nothing timed yet: a whole chunk
    assert pacer.ran(0, 0.010) is None
    assert pacer.budget_s(is_decoding=True) == pytest.approx(rounds * 0.010)
    pacer.ran(0, 0.020)  # smoothed, not replaced
    assert 0.010 < pacer.round_s < 0.020
    assert pacer.budget_s(is_decoding=False) is None  # no row waits on the prefill


@pytest.mark.parametrize("configured_s, expected_s", [(0.0, None), (0.05, 0.05)])
def test_a_configured_budget_wins_over_the_yardstick(configured_s, expected_s):
    pacer = PrefillPacer(True, configured_budget_s=configured_s)
    pacer.ran(0, 0.010)
    assert pacer.budget_s(is_decoding=True) == expected_s


def test_a_packed_chunk_is_charged_its_rounds_overrun_and_leaves_the_yardstick_alone():
    pacer = PrefillPacer(True, configured_budget_s=None)
    assert pacer.ran(32, 0.015) is None  # no plain round timed yet: nothing to charge against
    pacer.ran(0, 0.010)
    assert pacer.ran(32, 0.016) == pytest.approx(0.006)
    assert pacer.round_s == pytest.approx(0.010)


def test_one_round_in_so_many_runs_plain_to_keep_timing():
    pacer = PrefillPacer(True, configured_budget_s=None)
    pacer.ran(0, 0.010)
    for _ in range(PACKED_ROUNDS_PER_PLAIN):
        assert not pacer.is_paused(is_decoding=True)
        pacer.ran(16, 0.012)
    assert pacer.is_paused(is_decoding=True)
    assert not pacer.is_paused(is_decoding=False)
    pacer.ran(0, 0.010)
    assert not pacer.is_paused(is_decoding=True)
    assert not PrefillPacer(False, None).is_paused(is_decoding=True)  # rounds that never carry chunks


def test_packing_follows_the_config_else_fused_layers_or_the_models_size():
    assert is_packing_chosen(True, PACKING_MIN_WEIGHT_BYTES, False, None)
    assert not is_packing_chosen(True, PACKING_MIN_WEIGHT_BYTES - 1, False, None)
    assert is_packing_chosen(True, 1, True, None)  # fused layers run the segments in their one node
    assert is_packing_chosen(True, 1, False, True) and not is_packing_chosen(True, 1 << 40, True, False)
    assert not is_packing_chosen(False, 1 << 40, True, True)  # a model whose attention gmlx does not mirror
