"""Draft depth and width cap from measured costs: the expected-throughput model, the
calibration's cache, and the engine using a cost table."""

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gmlx.config import EngineConfig, env_overrides
from gmlx.drafters import make_drafter
from gmlx import engine as engine_module
from gmlx.engine import Engine
from gmlx.models.loader import load_model
from gmlx.platform import timing
from gmlx.request import SamplingParams
from gmlx.spec import calibration
from gmlx.spec.calibration import CostTable
from gmlx.spec.depth import MIN_TRIES_TO_STOP, PRIOR_ACCEPTANCE, PROBE_SPREAD, DepthPolicy, DraftCosts, expected_tokens
from gmlx.spec.served_costs import ServedCosts
from schedules import SoloReference, check_schedule, make_schedule, run_alone

# Width 1: verifying more positions is nearly free and drafts are cheap (memory-bound decode);
# width 4: every position costs a full forward (compute-bound), so drafting cannot pay there.
# A speculative round's own host work shows at depth 0 (1.3 against a plain round's 1.0).
SYNTHETIC = CostTable(widths=(1, 4), plain_s=(1.0, 1.0),
                      spec_s=((1.3, 1.07, 1.14, 1.21), (1.3, 2.1, 3.2, 4.3)))
# One draft for 1.8 plain rounds at one row: SmolLM2's shipped MTP head needs 0.8 acceptance to pay.
COSTLY = CostTable(widths=(1,), plain_s=(1.0,), spec_s=((1.3, 1.8, 2.4, 3.0),))


def test_expected_tokens_counts_the_bonus():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 3) == pytest.approx(1.875)
    assert expected_tokens(1.0, 3) == 4.0


@pytest.mark.parametrize("acceptance, width, expected_k", [
    (0.8, 1, 3),  # rates 1, 1.68, 2.14, 2.44 tokens per unit
    (0.2, 1, 1),  # rates 1, 1.12, 1.09, 1.03
    (0.05, 1, 0),  # drafts that are never taken are not worth even 7%
    (0.8, 4, 0),  # 1.8 tokens for 2.1 units: plain is faster
])
def test_synthetic_cost_table_picks_the_expected_depth(acceptance, width, expected_k):
    assert SYNTHETIC.best_depth(width, acceptance) == expected_k


def test_synthetic_cost_table_sets_the_width_cap():
    # Interpolated, width 3 still gains from one draft (1.8 tokens for 1.76 units); width 4 does not.
    assert SYNTHETIC.width_cap(0.8, max_rows=64) == 3
    assert SYNTHETIC.width_cap(0.8, max_rows=2) == 0  # it pays at every width the engine can reach
    assert SYNTHETIC.width_cap(0.01, max_rows=64) == 1  # never below one row


def test_default_cost_model_without_a_table():
    policy = DepthPolicy(k_max=3, costs=DraftCosts(verify_per_position=0.1, draft_per_token=0.1))
    assert policy.acceptance("r") == PRIOR_ACCEPTANCE == 0.6  # nothing tried yet
    assert policy.depths(["r"]) == [2] and policy.pays_to_draft(["r"])  # 1.96 / 1.4 beats 2.18 / 1.6, 1.6 / 1.2
    for _ in range(20):
        policy.observe("r", 1, 0)
    assert policy.depths(["r"]) == [0] and not policy.pays_to_draft(["r"])


def test_depth_policy_learns_each_rows_acceptance():
    policy = DepthPolicy(k_max=3, table=SYNTHETIC)
    four = ["new", "a", "b", "c"]
    assert policy.depths(four) == [0] * 4  # width 4: no acceptance would pay, so not even a probe
    for _ in range(MIN_TRIES_TO_STOP):
        for request_id in four:
            policy.observe(request_id, 1, 0)
    assert policy.depths(four) == [0] * 4
    assert policy.depths(["new"]) == [SYNTHETIC.best_depth(1, policy.acceptance("new"))]
    for _ in range(12):
        policy.observe("good", 3, 3)
        policy.observe("bad", 3, 0)
    # A rejected first draft is one tried draft a round: "bad" learns more slowly than "good".
    assert policy.acceptance("good") > 0.8 > 0.3 > policy.acceptance("bad")
    assert policy.depths(["good"]) == [3] and policy.depths(["bad"]) == [1] and policy.depths(["bad"], 3) == [0]
    for _ in range(40):  # at k = 0 nothing is tried: the estimate drifts back to the prior, a probe follows
        policy.observe("bad", 0, 0)
    assert policy.acceptance("bad") == pytest.approx(policy.prior_acceptance, abs=0.05)
    policy.forget("good")
    assert policy.acceptance("good") == policy.prior_acceptance


def test_gated_rounds_rest_every_row_but_the_scored_one():
    """A gated round fades each row's evidence toward the prior by the resting decay (applied
    when the row is next read, so a round costs one step at any width); the scored row is
    observed instead, and a row that joins later has no past rounds to fade."""
    from gmlx.spec import depth

    policy = DepthPolicy(k_max=3, table=SYNTHETIC)
    counts = {"rests": [0.0, 0.0], "scored": [0.0, 0.0]}  # decayed accepted, tried
    for _ in range(6):
        policy.observe("rests", 3, 3)  # three accepted of three tried
        policy.observe("scored", 3, 0)  # the first rejected: one tried
        counts["rests"] = [n * depth._DECAY + 3 for n in counts["rests"]]
        counts["scored"] = [counts["scored"][0] * depth._DECAY, counts["scored"][1] * depth._DECAY + 1]
    for _ in range(5):
        policy.rest("scored")
        policy.observe("scored", 1, 1)
        counts["scored"] = [n * depth._DECAY + 1 for n in counts["scored"]]
    policy.rest()
    policy.observe("joined", 1, 1)
    counts["rests"] = [n * depth._RESTING_DECAY ** 6 for n in counts["rests"]]
    counts["scored"] = [n * depth._RESTING_DECAY for n in counts["scored"]]
    counts["joined"] = [1.0, 1.0]
    prior, weight = policy.prior_acceptance, depth._PRIOR_WEIGHT
    for request_id, (accepted, tried) in counts.items():
        assert policy.acceptance(request_id) == pytest.approx((accepted + prior * weight) / (tried + weight), rel=1e-12)


def test_new_rows_probe_only_where_a_better_row_would_pay():
    """A new row drafts in its first rounds although the pooled acceptance says k = 0, but only
    where a row PROBE_SPREAD better than the pool would gain from drafts."""
    fresh = DepthPolicy(k_max=3, table=COSTLY)
    assert not fresh.pays_to_draft(["new"]) and fresh.depths(["new"]) == [1]  # 0.6 + 0.25 would pay
    for table in (SYNTHETIC, COSTLY):
        policy = DepthPolicy(k_max=3, table=table)
        for i in range(30):
            policy.observe(f"earlier{i}", 1, 0)
        assert policy.prior_acceptance + PROBE_SPREAD < 0.3 and not policy.pays_to_draft(["new"])
        # Cheap drafts: a row at 0.29 would gain, so it probes; dear ones: it would not, so no draft.
        assert policy.depths(["new"]) == ([1] if table is SYNTHETIC else [0])


def test_a_lone_stream_does_not_probe_drafts_that_cannot_pay(builtin_target):
    """Served: once the pooled acceptance says no row could gain, a new request decodes plain
    from its first round (gated), and its tokens are plain decoding's."""
    engine = Engine(builtin_target, make_drafter("mtp", builtin_target),
                    EngineConfig(is_served_costs=False), cost_table=COSTLY)
    prompt, params = [5, 9, 14, 3, 22], SamplingParams(max_tokens=12, temperature=0.0)
    run_alone(engine, prompt, params)
    assert engine.counters["num_spec_rounds"] > 0  # the first request probed
    for i in range(30):
        engine.policy.depth_policy.observe(f"earlier{i}", 1, 0)
    before = dict(engine.counters)
    assert run_alone(engine, prompt, params)[:2] == SoloReference(builtin_target).tokens(prompt, params)
    assert engine.counters["num_spec_rounds"] == before["num_spec_rounds"]
    assert engine.counters["num_gated_rounds"] > before["num_gated_rounds"]


def test_a_round_drafts_one_depth_for_its_rows_summed_tokens():
    """Every row of a ragged verify pays the deepest row's positions: a good row beside a row
    whose drafts mostly fail drafts shallower than it would alone, the depth where the pair gains most."""
    policy = DepthPolicy(k_max=3, table=SYNTHETIC)
    for _ in range(12):
        policy.observe("good", 3, 3)
        policy.observe("bad", 3, 0)
    alone, (shared, _) = policy.depths(["good"])[0], policy.depths(["good", "bad"])
    assert alone == 3 and 0 < shared < alone

    def tokens_per_s(k):  # the pair's round at depth k, width 2
        tokens = expected_tokens(policy.acceptance("good"), k) + expected_tokens(policy.acceptance("bad"), k)
        return tokens / SYNTHETIC.round_s(2, k)

    assert tokens_per_s(shared) > max(tokens_per_s(0), tokens_per_s(alone))  # the good row's own k gains less
    assert policy.pays_to_draft(["good", "bad"]) and not policy.pays_to_draft(["bad"], 3)


# Costs that grow with the depth, a depth-0 verify dearer than a pipelined plain round (SmolLM2-like).
GRADED = CostTable(widths=(1,), plain_s=(1.0,), spec_s=((1.2, 1.3, 1.4, 1.5),))


def graded_policy() -> DepthPolicy:
    """A policy that has seen drafts after 3-token matches kept and drafts after no match refused."""
    policy = DepthPolicy(k_max=3, table=GRADED)
    for _ in range(20):
        policy.observe("earlier", 3, 3, evidence_class=3)
        policy.observe("earlier", 3, 0, evidence_class=0)
    return policy


def test_evidence_sets_each_rounds_depth_and_a_bare_round_does_not_gate():
    """Drafts on strong evidence verify deep; a round without evidence verifies at depth 0 (no
    gate: the next round may match); the pooled classes serve a row that never drafted."""
    policy = graded_policy()
    assert policy.class_acceptance(3) > 0.9 and policy.class_acceptance(0) < 0.1
    policy.observe("r", 3, 2)  # the row's own estimate says its drafts pay (no probe)
    policy.observe("r", 3, 2)
    assert policy.round_depths(["r"], 0, [3]) == [3]
    assert policy.round_depths(["r"], 0, [0]) == [0]
    assert policy.round_depths(["r"], 0) == policy.depths(["r"]) != [0]  # without evidence: the row's estimate
    assert policy.round_depths(["new"], 0, [0]) == [0]  # the pooled prior pays: no probe, the class rules
    # An evidence class observed once moves only its own estimate.
    before = policy.class_acceptance(1)
    policy.observe("r", 3, 0, evidence_class=1)
    assert policy.class_acceptance(1) < before and policy.class_acceptance(3) > 0.9


def test_the_ledger_sets_each_width_groups_kept_drafts_beside_the_models_expectation():
    """Each drafting row-round adds a + ... + a^k (a: the acceptance its depth was chosen from)
    to its width group's expectation and its kept drafts beside it; a round that did not draft adds nothing."""
    policy = graded_policy()
    a3 = policy.class_acceptance(3)
    assert policy.round_depths(["x", "y"], 0, [3, 3]) == [3, 3]
    policy.observe("x", 3, 3, evidence_class=3)
    policy.observe("y", 3, 1, evidence_class=3)
    rows = [f"r{i}" for i in range(5)]
    k = policy.round_depths(rows, 0, [3] * 5)[0]
    assert k > 0
    a3_wide = policy.class_acceptance(3)  # moved by the first round's kept drafts
    for row in rows:
        policy.observe(row, k, 0, evidence_class=3)
    policy.observe("z", 3, 2)  # no round chose its depth: not in the ledger
    ledger = policy.describe()["kept_vs_expected"]
    assert set(ledger) == {"2", "4"}
    assert ledger["2"][0] == 2 and ledger["2"][2] == 4
    assert ledger["2"][1] == pytest.approx(2 * (expected_tokens(a3, 3) - 1), abs=0.05)
    assert ledger["4"][0] == 5 and ledger["4"][2] == 0
    assert ledger["4"][1] == pytest.approx(5 * (expected_tokens(a3_wide, k) - 1), abs=0.05)


def test_a_probing_row_drafts_whatever_its_evidence():
    """Where only a probe drafts (the pooled acceptance is low), the probe is not spent on
    a depth-0 round: it drafts at least once, so the row's estimate is measured."""
    policy = DepthPolicy(k_max=3, table=GRADED)
    for _ in range(10):
        policy.observe("earlier", 3, 0, evidence_class=0)
    assert not policy.pays_to_draft(["new"])
    assert policy.round_depths(["new"], 0, [0]) == [1]
    for _ in range(MIN_TRIES_TO_STOP):
        policy.observe("new", 1, 0, evidence_class=0)
    assert policy.round_depths(["new"], 0, [0]) is None  # probed and refused: the batch gates


def test_rounds_without_evidence_gate_the_batch_once_they_are_most_rounds():
    """A row whose drafts pay when drafted, on a text that rarely matches: its depth-0 verifies
    cost more than plain rounds, so the share of drafting rounds falls until the batch gates, and
    gated evidence of matches raises it again."""
    policy = graded_policy()
    for _ in range(4):
        policy.observe("r", 3, 2)
    depths = [policy.round_depths(["r"], 0, [0]) for _ in range(80)]
    gate = depths.index(None)
    assert 10 < gate and depths[:gate] == [[0]] * gate  # bare rounds first, then the gate
    assert not policy.pays_to_draft(["r"])
    for _ in range(40):
        policy.observe_share(3)
    assert policy.pays_to_draft(["r"])


def test_an_engine_learns_what_each_match_size_is_worth(builtin_target, code_prompts, monkeypatch):
    """n-gram drafts on code with the evidence on, each stream alone and greedy: exact, deeper
    matches accepted more often than none, rounds without a match run bare (plain, pipelined) and
    speculative rounds verify their lookahead (drafting past it, its own classes learned)."""
    reference = SoloReference(builtin_target)
    engine = Engine(builtin_target, make_drafter("ngram", builtin_target, num_draft_tokens=GRADED.k_max),
                    EngineConfig(is_served_costs=False), cost_table=GRADED)
    past_lookahead_rounds = []
    speculative_round = engine_module.speculative_round

    def recording_round(target, batch, drafter, num_draft_by_row, *args, **kwargs):
        past_lookahead_rounds.append(not batch.is_settled)
        return speculative_round(target, batch, drafter, num_draft_by_row, *args, **kwargs)

    monkeypatch.setattr(engine_module, "speculative_round", recording_round)
    params = SamplingParams(max_tokens=96)
    for prompt in code_prompts[:6]:
        assert run_alone(engine, prompt, params)[:2] == reference.tokens(prompt, params)
    classes = engine.stats()["draft_depth"]["class_acceptance"]
    assert classes["3"] > classes["0"] + 0.3, classes
    assert engine.counters["num_bare_rounds"] > 0 and any(past_lookahead_rounds)
    assert any(int(c) > 3 for c in classes), classes  # past a lookahead: classes of their own


def test_engine_uses_the_table_and_settings_still_win(builtin_target, monkeypatch):
    monkeypatch.delenv("GMLX_MTP_WIDTH_CAP", raising=False)
    drafter = make_drafter("mtp", builtin_target)
    engine = Engine(builtin_target, drafter, EngineConfig(), cost_table=SYNTHETIC)
    for _ in range(10):  # the drafter's acceptance so far (the prior of the cap's model) is high
        engine.policy.depth_policy.observe("earlier", 3, 3)
    stats = engine.stats()
    prior = engine.policy.depth_policy.prior_acceptance
    assert stats["width_cap"] == SYNTHETIC.width_cap(prior, 64) == 3 != drafter.default_width_cap
    assert stats["calibration"]["best_depth"] == [SYNTHETIC.best_depth(w, prior) for w in (1, 4)]
    engine.policy.depth_policy.observe("any", 0, 0)  # past its probing round
    assert engine.policy.depth_policy.depths(["any"]) == [SYNTHETIC.best_depth(1, prior)]
    assert Engine(builtin_target, drafter, EngineConfig(speculative_width_cap=7),
                  cost_table=SYNTHETIC).stats()["width_cap"] == 7
    monkeypatch.setenv("GMLX_MTP_WIDTH_CAP", "5")
    assert engine.stats()["width_cap"] == 5


def test_engine_with_a_table_equals_plain(builtin_target, code_prompts):
    """Depths and gates chosen by the table (k = 0 at width 4) keep every stream exact."""
    reference = SoloReference(builtin_target)
    # The table alone: served rounds (milliseconds) would rescale its unit costs.
    engine = Engine(builtin_target, make_drafter("draft", builtin_target),
                    EngineConfig(prefill_chunk_tokens=64, is_served_costs=False), cost_table=SYNTHETIC)
    totals = {}
    for seed in range(6):
        schedule = make_schedule(20_000 + seed, builtin_target.vocab_size, code_prompts, max_requests=6)
        result = check_schedule(engine, reference, schedule)
        for key, value in result.counters.items():
            totals[key] = totals.get(key, 0) + value
    assert totals["num_spec_rounds"] > 0 and totals["num_depth_gates"] > 0


def test_calibration_is_measured_once_then_read_from_the_cache(tiny_target, tmp_path, monkeypatch):
    monkeypatch.setenv("GMLX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(timing, "MAX_OTHER_LOAD", 1.0)  # caching, whatever else this machine runs
    monkeypatch.setenv("GMLX_CALIBRATE", "auto")
    drafter = make_drafter("ngram", tiny_target)
    table = calibration.load_or_measure(tiny_target, drafter, max_rows=4)
    assert table.widths == (1, 2, 4) and table.k_max == drafter.num_draft_tokens
    for row in table.spec_s:  # more drafts never cost less
        assert list(row) == sorted(row) and all(s > 0 for s in row)
    assert list(table.plain_s) == sorted(table.plain_s) and all(s > 0 for s in table.plain_s)
    assert (tmp_path / "spec_calibration.json").exists()
    assert calibration.load_or_measure(tiny_target, drafter, max_rows=4) == table
    monkeypatch.setenv("GMLX_CALIBRATE", "off")
    assert calibration.load_or_measure(tiny_target, drafter, max_rows=4) is None


def test_a_pipelined_round_is_timed_back_to_back_not_by_its_fastest_call():
    """A pipelined plain round waits for the forward the round before dispatched, or finds it done
    and returns at once: calls alternate, and the fastest single call would price the round at its
    host work alone (session 44: 0.3 ms for a 1.8 ms round, then every narrower width too)."""
    calls = []

    def alternating_round():  # waits 20 ms every other call, like a forward found running or done
        calls.append(1)
        if len(calls) % 2 == 0:
            time.sleep(0.020)

    assert calibration._fastest_round_s(alternating_round) < 0.005  # the defect, timed one call at a time
    per_round_s = calibration._fastest_round_s(alternating_round, calibration.PLAIN_ROUNDS_PER_TIMING)
    assert per_round_s >= 0.009  # half the rounds wait: ~10 ms a round


def test_calibration_is_measured_again_when_a_cpu_kernel_switch_changes(tiny_target, tmp_path, monkeypatch):
    """The kernels set the costs: a table measured with one GMLX_CPU_* setting is not read under another."""
    monkeypatch.setenv("GMLX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(timing, "MAX_OTHER_LOAD", 1.0)
    monkeypatch.setenv("GMLX_CALIBRATE", "auto")
    monkeypatch.delenv("GMLX_CPU_FUSED_LAYERS", raising=False)
    drafter = make_drafter("ngram", tiny_target)
    calibration.load_or_measure(tiny_target, drafter, max_rows=2)
    monkeypatch.setenv("GMLX_CPU_FUSED_LAYERS", "0")
    calibration.load_or_measure(tiny_target, drafter, max_rows=2)
    assert len(json.loads((tmp_path / "spec_calibration.json").read_text())) == 2


def test_calibration_is_measured_again_for_a_model_loaded_under_the_row_rules(tiny_target, tiny_llama_dir, tmp_path,
                                                                              monkeypatch):
    """A GPU's round costs change with the row-invariance rules (2-3x on an H200), so the rules a
    model was loaded under are part of its table's key; the settings read later are not."""
    monkeypatch.setenv("GMLX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(timing, "MAX_OTHER_LOAD", 1.0)
    monkeypatch.setenv("GMLX_CALIBRATE", "auto")
    with env_overrides({"GMLX_ROW_INVARIANCE": "1", "GMLX_PRODUCT_BLOCK_ROWS": "8"}):
        ruled = load_model(tiny_llama_dir)
    assert ruled.body.row_rules is not None
    for target in (tiny_target, ruled, tiny_target):  # the last reads the first's entry back
        calibration.load_or_measure(target, make_drafter("ngram", target), max_rows=2)
    assert len(json.loads((tmp_path / "spec_calibration.json").read_text())) == 2


def test_calibration_is_measured_again_when_a_gguf_file_changes(tiny_llama_dir, tmp_path, monkeypatch):
    """A GGUF replaced at the same path (another quantization, say) is not read with the old file's costs."""
    from gguf_support import write_gguf_from_folder

    monkeypatch.setenv("GMLX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("GMLX_CALIBRATE", "auto")
    monkeypatch.setattr(timing, "MAX_OTHER_LOAD", 1.0)
    path = write_gguf_from_folder(Path(tiny_llama_dir), tmp_path / "model.gguf")
    target = load_model(path)
    drafter = make_drafter("ngram", target)
    calibration.load_or_measure(target, drafter, max_rows=2)
    calibration.load_or_measure(target, drafter, max_rows=2)  # read back: still one entry
    assert len(json.loads((tmp_path / "spec_calibration.json").read_text())) == 1
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    calibration.load_or_measure(target, drafter, max_rows=2)
    assert len(json.loads((tmp_path / "spec_calibration.json").read_text())) == 2


@pytest.mark.skipif(timing._cpu_ticks() is None, reason="the OS does not report machine CPU time")
def test_a_calibration_disturbed_by_other_processes_is_not_cached(tiny_target, tmp_path, monkeypatch, caplog):
    """Real processes spin on every core while it measures: each attempt sees them, so the costs
    serve this process only (each cell's fastest reading) and the cache stays empty."""
    monkeypatch.setenv("GMLX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("GMLX_CALIBRATE", "auto")
    drafter = make_drafter("ngram", tiny_target)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.5)  # running before the first attempt starts
        with caplog.at_level(logging.WARNING, logger="gmlx.spec.calibration"):
            table = calibration.load_or_measure(tiny_target, drafter, max_rows=2)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert table.widths == (1, 2) and table.k_max == drafter.num_draft_tokens
    assert not (tmp_path / "spec_calibration.json").exists()
    assert "not cached" in caplog.text


@pytest.mark.parametrize("kind", ["mtp", "draft", "ngram"])
def test_calibration_times_real_rounds_with_every_drafter(kind, builtin_target):
    """The timed rounds deliver their tokens as the engine does (a draft model reads its history
    from the requests), so every drafter's rounds run: plain and speculative at each depth."""
    drafter = make_drafter(kind, builtin_target)
    table = calibration.measure(builtin_target, drafter, max_rows=2)
    assert table.widths == (1, 2) and table.k_max == drafter.num_draft_tokens
    assert all(s > 0 for s in table.plain_s) and all(s > 0 for row in table.spec_s for s in row)


def _serve_rounds(costs: ServedCosts, width: int, depth: int, round_s: float, num_rounds: int, now_s: float) -> float:
    """Steady rounds of one shape, back to back, each taking round_s from its start to the next step."""
    for _ in range(num_rounds):
        costs.step_started(now_s)
        costs.ran(now_s, width, depth)
        now_s += round_s
    costs.step_started(now_s)
    return now_s


def test_served_costs_weigh_the_table_by_the_rounds_as_served():
    costs = ServedCosts(SYNTHETIC)
    assert costs.describe(0.8, 64)["best_depth"][0] == 3 and costs.width_cap(0.8, 64) == 3  # nothing served: the table
    # Served plain rounds cost what the table says; speculative ones three times as much (a worker
    # that publishes between rounds, which only a plain round's dispatched-ahead forward hides).
    now_s = _serve_rounds(costs, 1, 0, 1.0, 40, 0.0)
    now_s = _serve_rounds(costs, 1, 3, 3 * 1.21, 40, now_s)
    assert costs.spec_scale(1) == pytest.approx(3.0)
    assert costs.describe(0.8, 64)["best_depth"][0] == 0  # width 1: 2.95 tokens for 3.63 units, plain is faster
    assert costs.width_cap(0.8, 64) == 1
    assert costs.describe(0.8, 64)["served"]["1"]["num_rounds"] == 78  # the first of each shape is not timed
    # Twice as slow for both kinds (a busy machine): the choice is the table's again.
    _serve_rounds(costs, 2, 0, 2.0, 40, _serve_rounds(costs, 2, 1, 2 * SYNTHETIC.round_s(2, 1), 40, now_s))
    assert costs.spec_scale(2) == pytest.approx(1.0)


def test_served_costs_time_only_steady_rounds():
    costs = ServedCosts(SYNTHETIC)
    now_s = 0.0
    for depth in [0, 3] * 20:  # every round changes shape: each still pays its switch, none is timed
        costs.step_started(now_s)
        costs.ran(now_s, 1, depth)
        now_s += 10.0
    costs.ran(now_s, 1, None)  # a transition or a packed prompt chunk
    costs.step_started(now_s + 10.0)
    costs.ran(now_s + 10.0, 1, 3)
    costs.interrupted()  # the engine went idle: the wait before the next step is not a round
    costs.step_started(now_s + 100.0)
    assert costs.describe(0.8, 64)["served"] == {}
    assert costs.spec_scale(1) == 1.0


def test_served_costs_guess_only_toward_plain_where_one_kind_has_not_run():
    costs = ServedCosts(SYNTHETIC)
    now_s = _serve_rounds(costs, 1, 3, 1.0 * SYNTHETIC.round_s(1, 3), 20, 0.0)  # a lone stream drafting
    now_s = _serve_rounds(costs, 4, 0, 2.0 * SYNTHETIC.round_s(4, 0), 20, now_s)  # a gated batch of four
    # Compared across widths, drafting would look half as dear as the table says: not believed.
    assert costs.spec_scale(1) == costs.spec_scale(4) == 1.0
    _serve_rounds(costs, 1, 0, 0.5 * SYNTHETIC.round_s(1, 0), 20, now_s)  # width 1 plain: now a pair
    assert costs.spec_scale(1) == pytest.approx(2.0)  # measured at one width, believed either way
    assert costs.spec_scale(2) == pytest.approx(2.0)  # the nearest pair


def test_a_gated_width_takes_the_nearest_pairs_scale_and_the_cap_opens_one_row_past_the_table():
    """A gated width serves no speculative round, so its own ratios never reopen it: the nearest
    width that served both kinds prices its drafts, and the cap may open to it, one row past the
    table's cap at most; once it drafts, its own ratios decide."""
    costs = ServedCosts(SYNTHETIC)
    now_s = _serve_rounds(costs, 1, 3, 1.0 * SYNTHETIC.round_s(1, 3), 20, 0.0)  # a lone stream drafting
    now_s = _serve_rounds(costs, 1, 0, 2.0 * SYNTHETIC.round_s(1, 0), 20, now_s)  # and gated: width 1's pair, 0.5
    now_s = _serve_rounds(costs, 4, 0, 1.5 * SYNTHETIC.round_s(4, 0), 20, now_s)  # a gated batch of four
    assert costs.round_s(4, 1) == pytest.approx(0.5 * SYNTHETIC.round_s(4, 1))
    assert costs.spec_scale(4) == 1.0  # the scale across kinds and widths stays one-sided
    # The table drafts up to width 3 at 0.8; width 4 at half the cost pays (1.8 tokens for 1.05).
    assert SYNTHETIC.width_cap(0.8, 64) == 3 and costs.width_cap(0.8, 64) == 4
    # Width 4's own drafting, at twice plain's served ratio there, closes it again (and width 3,
    # whose nearest pair it now is, with it).
    _serve_rounds(costs, 4, 1, 3.0 * SYNTHETIC.round_s(4, 1), 20, now_s)
    assert costs.round_s(4, 1) == pytest.approx(2.0 * SYNTHETIC.round_s(4, 1))
    assert costs.width_cap(0.8, 64) == 2


def test_before_any_speculative_round_is_served_it_pays_the_plain_rounds_served_excess():
    """A gated lone stream learns what a round costs served from its plain rounds alone: the
    same excess a round, added to a speculative round's table cost (COSTLY: 3 drafts at 3x)."""
    costs = ServedCosts(COSTLY)
    assert costs.round_s(1, 3) == 3.0  # nothing served: the table
    _serve_rounds(costs, 1, 0, 3.0, 40, 0.0)  # plain rounds served at 3x the table: 2.0 past it each
    assert costs.round_s(1, 0) == 1.0 and costs.round_s(1, 3) == pytest.approx((3.0 + 2.0) / 3.0)
    # In plain-round units a 3-draft round now costs 1.67, not 3.0: at 0.7 acceptance it pays.
    policy = DepthPolicy(3, table=costs)
    assert policy._depth_for([0.7], 0) == 3 and DepthPolicy(3, table=COSTLY)._depth_for([0.7], 0) == 0
    _serve_rounds(costs, 1, 3, 1.5 * 3.0, 40, 200.0)  # once speculative rounds are served, their own ratio
    assert costs.round_s(1, 3) == pytest.approx(3.0 * 1.5 / 3.0)


def test_an_engine_times_its_served_rounds_and_streams_plain_decodings_tokens(builtin_target, code_prompts):
    """The engine with a measured table: steady rounds feed the served correction (stats show
    it per width), and the stream is still plain decoding's."""
    drafter = make_drafter("ngram", builtin_target)
    engine = Engine(builtin_target, drafter, EngineConfig(), cost_table=calibration.measure(builtin_target, drafter, 2))
    params = SamplingParams(max_tokens=96)
    tokens, _, _ = run_alone(engine, code_prompts[0], params)
    assert tokens == SoloReference(builtin_target).tokens(code_prompts[0], params)[0]
    served = engine.stats()["calibration"]["served"]["1"]
    assert served["num_rounds"] > 0 and (served["plain_ratio"] or served["spec_ratio"]) > 0
