"""Five engine defects found by driving the engine directly, each pinned by a test that
failed before its fix: sliding-window models, settings validated at start-up, the resume
threshold (off by one, and checked twice), preempting for a waiter that cannot join yet,
and a gate that landed straight after a preempt going uncounted."""

import json

import pytest

from conftest import make_random_model_dir
from gmlx.config import EngineConfig
from gmlx.drafters import make_drafter
from gmlx.engine import Engine
from gmlx.request import Request, SamplingParams
from gmlx.spec import admission
from gmlx.spec.batch import BatchMode
from schedules import SoloReference


@pytest.fixture(scope="module")
def reference(builtin_target):
    return SoloReference(builtin_target)


@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_a_sliding_window_model_is_refused_at_load(tmp_path, model_type):
    folder = make_random_model_dir(tmp_path / "sw", "llama", layer_types=["sliding_attention", "full_attention"],
                                   sliding_window=8)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"model_type": model_type}))
    with pytest.raises(ValueError, match="sliding-window attention .*not supported"):
        Engine.load(EngineConfig(model_path=str(folder)))


@pytest.mark.parametrize("name, raw", [("GMLX_MTP_PREEMPT", "maybe"), ("GMLX_MTP_RESUME", "2"),
                                       ("GMLX_MTP_WIDTH_CAP", "-1"), ("GMLX_RESUME_MIN_BUDGET", "x"),
                                       ("GMLX_FUSE_CPU_OPS", "yes please"), ("GMLX_LOG_LEVEL", "LOUD")])
def test_a_malformed_setting_is_refused_at_start_up(builtin_target, monkeypatch, name, raw):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=name):
        Engine(builtin_target, make_drafter("ngram", builtin_target), EngineConfig())


def test_the_resume_threshold_counts_as_the_readme_says(monkeypatch):
    # README: "rows with fewer tokens left than this do not trigger a resume".
    monkeypatch.setenv("GMLX_RESUME_MIN_BUDGET", "8")
    request = Request("a", [1], SamplingParams(max_tokens=10), seed=0)
    request.output_token_ids.extend([5, 6])  # 8 left: not fewer than 8
    assert request.num_remaining == 8 and admission.can_resume([request])
    request.output_token_ids.append(7)  # 7 left
    assert not admission.can_resume([request])


def run_resume_scenario(target, monkeypatch, min_budget: int) -> tuple[Engine, int | None]:
    """Cap 2, three rows, the short one leaves: the gated pair drains within the cap.
    Returns the engine and the most tokens any row had left when the settle round ran."""
    monkeypatch.setenv("GMLX_MTP_WIDTH_CAP", "2")
    monkeypatch.setenv("GMLX_RESUME_MIN_BUDGET", str(min_budget))
    engine = Engine(target, make_drafter("mtp", target), EngineConfig(prefill_chunk_tokens=4096))
    tokens = target.tokenizer.encode("def main():\n    return 1\n")
    for n in (40, 30, 5):
        engine.add_request(tokens, SamplingParams(max_tokens=n))
    remaining_at_settle = None
    while engine.has_unfinished():
        before = engine.counters["num_settle_rounds"]
        remaining = max((r.num_remaining for r in engine.batch.requests), default=0) if engine.batch else 0
        engine.step()
        if engine.counters["num_settle_rounds"] > before and remaining_at_settle is None:
            remaining_at_settle = remaining
    return engine, remaining_at_settle


def test_resume_is_decided_once_before_the_settle(builtin_target, monkeypatch):
    _, remaining = run_resume_scenario(builtin_target, monkeypatch, 0)
    assert remaining is not None and remaining > 2
    # Exactly at the threshold resumes; one below the decision still resumes (no second check
    # at the capture round); one above does not even settle.
    for min_budget, num_resumes in ((remaining - 1, 1), (remaining, 1), (remaining + 1, 0)):
        engine, _ = run_resume_scenario(builtin_target, monkeypatch, min_budget)
        counters = engine.counters
        assert counters["num_resumes"] == num_resumes, (min_budget, counters)
        assert counters["num_settle_rounds"] == counters["num_capture_rounds"] == num_resumes, (min_budget, counters)


def test_a_long_waiter_preempts_only_when_it_can_join(builtin_target, reference, code_prompts, monkeypatch):
    monkeypatch.setenv("GMLX_MTP_PREEMPT", "1")
    engine = Engine(builtin_target, make_drafter("mtp", builtin_target), EngineConfig(prefill_chunk_tokens=16))
    long_prompt = [t for p in code_prompts for t in p][:70]  # more than four chunks
    params = {"A": SamplingParams(max_tokens=50), "B": SamplingParams(max_tokens=12, temperature=0.8, seed=3)}
    prompts = {"A": builtin_target.tokenizer.encode("def main():\n    return 1\n"), "B": long_prompt}
    engine.add_request(prompts["A"], params["A"], request_id="A")
    got = {"A": [], "B": []}
    for step in range(10_000):
        if step == 3:
            assert engine.batch.mode is BatchMode.SCALAR
            engine.add_request(prompts["B"], params["B"], request_id="B")
        num_preempts = engine.counters["num_preempts"]
        for output in engine.step():
            got[output.request_id].extend(output.new_token_ids)
        if engine.counters["num_preempts"] > num_preempts:
            assert engine.batch.num_rows == 2, f"preempted at step {step}, but the waiter did not join"
        if not engine.has_unfinished():
            break
    assert engine.counters["num_preempts"] == 1
    for request_id in got:
        assert got[request_id] == reference.tokens(prompts[request_id], params[request_id])[0]


@pytest.mark.parametrize("is_packed", [False, True])
def test_a_preempt_landing_over_the_cap_counts_a_gate(builtin_target, code_prompts, monkeypatch, is_packed):
    monkeypatch.setenv("GMLX_MTP_WIDTH_CAP", "1")
    engine = Engine(builtin_target, make_drafter("mtp", builtin_target), EngineConfig(is_prefill_packed=is_packed))
    engine.add_request(code_prompts[0], SamplingParams(max_tokens=40))
    for _ in range(3):
        engine.step()
    assert engine.batch.mode is BatchMode.SCALAR
    engine.add_request(code_prompts[1][:8], SamplingParams(max_tokens=30))
    # The waiter is prefilled beside the lone stream (apart, or packed into its round and read
    # the step after), its first token out...
    for _ in range(2 if is_packed else 1):
        engine.step()
        assert engine.counters["num_preempts"] == 0 and engine.batch.num_rows == 1
    assert engine.counters["num_packed_chunks"] == is_packed
    engine.step()  # ...and joins one step later: preempt and join in one step
    assert engine.counters["num_preempts"] == 1 and engine.batch.num_rows == 2
    assert engine.counters["num_gates"] == 1
    while engine.has_unfinished():
        engine.step()
    assert engine.counters["num_resumes"] <= engine.counters["num_gates"]
