"""Preempt, gate, resume and the prompt cache: continuity under random schedules."""

import pytest

from gmlx.config import EngineConfig
from gmlx.drafters import make_drafter
from gmlx.engine import Engine
from gmlx.request import SamplingParams
from schedules import SoloReference, check_schedule, make_schedule

DRAFTERS = ("mtp", "draft", "ngram")
NUM_CHUNKS, SCHEDULES_PER_CHUNK = 6, 30  # 3 drafters x 6 x 30 = 540 schedules
# The MTP drafter's first chunk runs in the fast tier (pytest -m "not slow"), every chunk in the full run.
CASES = [pytest.param(chunk, kind, marks=() if (kind, chunk) == ("mtp", 0) else pytest.mark.slow)
         for chunk in range(NUM_CHUNKS) for kind in DRAFTERS]
TRANSITIONS = ("num_preempts", "num_resumes", "num_capture_rounds", "num_gated_rounds", "num_gates")


@pytest.fixture(scope="module")
def reference(builtin_target):
    return SoloReference(builtin_target)


@pytest.fixture(scope="module")
def engines(builtin_target):
    # Fixed depth: batches speculate until the cap or a preempt moves them, whatever the drafter's
    # acceptance; the depth gate's transitions have their own random schedules (test_speculative,
    # test_depth).
    config = EngineConfig(prefill_chunk_tokens=64, is_adaptive_depth=False)
    return {kind: Engine(builtin_target, make_drafter(kind, builtin_target), config) for kind in DRAFTERS}


@pytest.mark.parametrize("chunk, kind", CASES)
def test_every_transition_keeps_streams_continuous(kind, chunk, engines, reference, code_prompts):
    totals = dict.fromkeys(TRANSITIONS, 0)
    for i in range(SCHEDULES_PER_CHUNK):
        seed = 50_000 + 1000 * DRAFTERS.index(kind) + chunk * SCHEDULES_PER_CHUNK + i
        schedule = make_schedule(seed, engines[kind].target.vocab_size, code_prompts, max_requests=6,
                                 caps=(1, 2, 3))
        result = check_schedule(engines[kind], reference, schedule)
        for key in TRANSITIONS:
            totals[key] += result.counters[key]
    assert all(totals[k] > 0 for k in TRANSITIONS), totals


def first_token_round(engine, request_id, arrive_after_rounds, first_id, first_prompt, prompt, params):
    """Run A alone for a few rounds, add B; return (rounds until B's first token, rounds left for A)."""
    a_done_at = b_first_at = None
    for step in range(10_000):
        if step == arrive_after_rounds:
            engine.add_request(prompt, params, request_id=request_id)
        for output in engine.step():
            if output.request_id == request_id and b_first_at is None and output.new_token_ids:
                b_first_at = step
            if output.request_id == first_id and output.finish_reason:
                a_done_at = step
        if not engine.has_unfinished():
            break
    return b_first_at - arrive_after_rounds, a_done_at


@pytest.mark.parametrize("is_preempt_on", [True, False])
def test_a_waiter_preempts_the_scalar_stream(is_preempt_on, builtin_target, reference, code_prompts, monkeypatch):
    monkeypatch.setenv("GMLX_MTP_PREEMPT", "1" if is_preempt_on else "0")
    engine = Engine(builtin_target, make_drafter("mtp", builtin_target), EngineConfig())
    a_params, b_params = SamplingParams(max_tokens=60), SamplingParams(max_tokens=10, temperature=0.8, seed=5)
    engine.add_request(code_prompts[0], a_params, request_id="A")
    b_wait, a_done = first_token_round(engine, "B", 4, "A", code_prompts[0], code_prompts[1], b_params)
    if is_preempt_on:
        assert b_wait <= 1 and engine.counters["num_preempts"] == 1
    else:
        assert b_wait > a_done - 4 and engine.counters["num_preempts"] == 0


def test_resume_rearms_a_drained_batch(builtin_target, reference, code_prompts, monkeypatch):
    monkeypatch.setenv("GMLX_MTP_WIDTH_CAP", "2")
    monkeypatch.setenv("GMLX_RESUME_MIN_BUDGET", "8")
    engine = Engine(builtin_target, make_drafter("mtp", builtin_target), EngineConfig(prefill_chunk_tokens=4096))
    budgets = [60, 50, 5]  # the short one leaves; the batch drops back within the cap
    ids = [engine.add_request(p, SamplingParams(max_tokens=n)) for p, n in zip(code_prompts, budgets)]
    got = {i: [] for i in ids}
    while engine.has_unfinished():
        for output in engine.step():
            got[output.request_id].extend(output.new_token_ids)
    kinds = [e["kind"] for e in engine.stats()["events"]]
    assert engine.counters["num_resumes"] == 1 and engine.counters["num_settle_rounds"] == 1
    assert kinds.index("resume") > kinds.index("admit")
    for prompt, n, request_id in zip(code_prompts, budgets, ids):
        assert got[request_id] == reference.tokens(prompt, SamplingParams(max_tokens=n))[0]


def test_resume_off_latches_the_gate(builtin_target, code_prompts, monkeypatch):
    monkeypatch.setenv("GMLX_MTP_WIDTH_CAP", "2")
    monkeypatch.setenv("GMLX_MTP_RESUME", "0")
    engine = Engine(builtin_target, make_drafter("mtp", builtin_target), EngineConfig(prefill_chunk_tokens=4096))
    for prompt, n in zip(code_prompts, [60, 50, 5]):
        engine.add_request(prompt, SamplingParams(max_tokens=n))
    while engine.has_unfinished():
        engine.step()
    assert engine.counters["num_resumes"] == 0 and engine.counters["num_capture_rounds"] == 0
    assert engine.counters["num_spec_rounds"] == 0


def test_repeated_prompt_skips_prefill_and_preempted_is_not_offered(builtin_target, reference, code_prompts):
    # Fixed depth: the lone stream is still speculating (not depth-gated) when the waiter comes.
    engine = Engine(builtin_target, make_drafter("mtp", builtin_target), EngineConfig(is_adaptive_depth=False))
    prompt = code_prompts[5] * 3
    params = SamplingParams(max_tokens=8)
    outs = []
    for _ in range(2):
        engine.add_request(prompt, params)
        tokens, stats = [], None
        while engine.has_unfinished():
            for output in engine.step():
                tokens.extend(output.new_token_ids)
                stats = output.stats or stats
        outs.append((tokens, stats))
    assert outs[0][1]["cached_prompt_tokens"] == 0
    assert outs[1][1]["cached_prompt_tokens"] == len(prompt) - 1
    assert outs[0][0] == outs[1][0] == reference.tokens(prompt, params)[0]

    entries = engine.prompt_cache.stats()["prompt_cache_entries"]
    engine.add_request(code_prompts[6], SamplingParams(max_tokens=30), request_id="scalar")
    engine.step()
    engine.add_request(code_prompts[7], SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    assert engine.counters["num_preempts"] == 1
    # Only the waiter retired; the preempted request dropped its retirement context.
    assert engine.prompt_cache.stats()["prompt_cache_entries"] == entries + 1


def _run_with_rows_by_round(engine, prompts, budgets):
    """Runs one request a budget to the end: their ids, tokens by id, and each round's (rows, mode)."""
    ids = [engine.add_request(p, SamplingParams(max_tokens=n)) for p, n in zip(prompts, budgets)]
    got = {i: [] for i in ids}
    rows_by_round = {}
    while engine.has_unfinished():
        if engine.batch is not None:
            rows_by_round[engine.counters["num_rounds"]] = (engine.batch.num_rows, engine.batch.mode.value)
        for output in engine.step():
            got[output.request_id].extend(output.new_token_ids)
    return ids, got, rows_by_round


def test_a_gated_batch_checks_for_a_resume_one_round_in_four_and_waits_for_leavers_to_return(
        builtin_target, reference, code_prompts, monkeypatch):
    # Cap 2, three rows: gated. With its rows unchanged the batch asks whether to resume on one
    # round in GATED_RECHECK_ROUNDS; once the short row leaves, it stays gated for
    # RESUME_AFTER_LEAVE_ROUNDS (the leaver's client may send its next prompt), then resumes.
    from gmlx.spec import policy as policy_module

    monkeypatch.setenv("GMLX_MTP_WIDTH_CAP", "2")
    monkeypatch.setenv("GMLX_RESUME_MIN_BUDGET", "8")
    engine = Engine(builtin_target, make_drafter("mtp", builtin_target), EngineConfig(prefill_chunk_tokens=4096))
    checks = []
    width_cap = engine.policy.width_cap
    monkeypatch.setattr(engine.policy, "width_cap", lambda: checks.append(engine.counters["num_rounds"]) or width_cap())
    budgets = [60, 50, 12]
    ids, got, rows_by_round = _run_with_rows_by_round(engine, code_prompts, budgets)
    gated = [r for r, (num_rows, mode) in rows_by_round.items() if mode == "gated" and num_rows == 3]
    assert len(gated) >= 2 * policy_module.GATED_RECHECK_ROUNDS
    checked_while_gated = [r for r in gated if r in checks]
    assert len(checked_while_gated) <= len(gated) // policy_module.GATED_RECHECK_ROUNDS + 1, (gated, checks)
    first_two_rows = min(r for r, (num_rows, _) in rows_by_round.items() if num_rows == 2)
    held = range(first_two_rows, first_two_rows + policy_module.RESUME_AFTER_LEAVE_ROUNDS)
    assert [rows_by_round[r] for r in held] == [(2, "gated")] * len(held)
    assert engine.counters["num_resumes"] == 1
    # Asked once the hold ran out: a settle round, then the capture that resumes.
    resume = next(e for e in engine.stats()["events"] if e["kind"] == "resume")
    assert resume["round"] == held.stop + 1, (first_two_rows, resume)
    for prompt, n, request_id in zip(code_prompts, budgets, ids):
        assert got[request_id] == reference.tokens(prompt, SamplingParams(max_tokens=n))[0]


def test_staggered_leaves_from_a_batch_over_the_cap_restart_the_wait(builtin_target, reference, code_prompts,
                                                                     monkeypatch):
    # Cap 2, three rows: gated. Two short rows leave three rounds apart; the first brings the
    # batch within the cap, and the second (the first one's wait not over) starts the wait
    # again, so the batch resumes only RESUME_AFTER_LEAVE_ROUNDS after the last leaver.
    from gmlx.spec import policy as policy_module

    monkeypatch.setenv("GMLX_MTP_WIDTH_CAP", "2")
    monkeypatch.setenv("GMLX_RESUME_MIN_BUDGET", "8")
    engine = Engine(builtin_target, make_drafter("mtp", builtin_target), EngineConfig(prefill_chunk_tokens=4096))
    budgets = [60, 14, 11]
    ids, got, rows_by_round = _run_with_rows_by_round(engine, code_prompts, budgets)
    resume = next(e for e in engine.stats()["events"] if e["kind"] == "resume")
    leaves = [r for r in rows_by_round if r - 1 in rows_by_round and r < resume["round"]
              and rows_by_round[r][0] < rows_by_round[r - 1][0]]
    assert len(leaves) == 2 and leaves[1] - leaves[0] < policy_module.RESUME_AFTER_LEAVE_ROUNDS, leaves
    assert resume["round"] == leaves[1] + policy_module.RESUME_AFTER_LEAVE_ROUNDS + 1, (leaves, resume)
    assert all(rows_by_round[r][1] == "gated" for r in range(leaves[0], resume["round"] - 1))
    assert engine.counters["num_resumes"] == 1
    for prompt, n, request_id in zip(code_prompts, budgets, ids):
        assert got[request_id] == reference.tokens(prompt, SamplingParams(max_tokens=n))[0]


def test_a_gated_batch_does_not_resume_for_the_rounds_before_waiters_take_it_over_the_cap(
        builtin_target, reference, code_prompts, monkeypatch):
    # Cap 2, three rows: gated. The short row leaves as a fourth prompt arrives: back within the
    # cap, but the waiter takes it over again a step later, so a resume would buy a settle and a
    # capture for nothing. Once the waiter has joined and a row leaves, the batch resumes.
    monkeypatch.setenv("GMLX_MTP_WIDTH_CAP", "2")
    monkeypatch.setenv("GMLX_RESUME_MIN_BUDGET", "8")
    engine = Engine(builtin_target, make_drafter("mtp", builtin_target), EngineConfig(prefill_chunk_tokens=4096))
    budgets = [60, 40, 5, 50]
    ids = [engine.add_request(p, SamplingParams(max_tokens=n)) for p, n in zip(code_prompts, budgets[:3])]
    got = {i: [] for i in ids}
    short_left_at = None
    while engine.has_unfinished():
        for output in engine.step():
            got[output.request_id].extend(output.new_token_ids)
            if output.request_id == ids[2] and output.finish_reason:
                short_left_at = engine.counters["num_rounds"]
                ids.append(engine.add_request(code_prompts[3], SamplingParams(max_tokens=budgets[3])))
                got[ids[3]] = []
    events = engine.stats()["events"]
    joined_at = max(e["round"] for e in events if e["kind"] == "admit")
    assert short_left_at is not None and joined_at > short_left_at
    resumes = [e["round"] for e in events if e["kind"] == "resume"]
    assert resumes and not [r for r in resumes if short_left_at <= r <= joined_at], (short_left_at, joined_at, resumes)
    assert engine.counters["num_settle_rounds"] == len(resumes)
    # The events say why each resume came (the policy's expected gain over plain decoding) and
    # what each armed stretch drafted and kept before its gate.
    assert all(e["expected_gain"] > 1 for e in events if e["kind"] == "resume")
    stretches = [e for e in events if e["kind"] == "gate" and "drafted" in e]
    assert stretches and all(0 <= e["accepted"] <= e["drafted"] for e in stretches)
    assert sum(e["drafted"] for e in stretches) <= engine.counters["num_drafted"]
    for prompt, n, request_id in zip(code_prompts, budgets, ids):
        assert got[request_id] == reference.tokens(prompt, SamplingParams(max_tokens=n))[0]
