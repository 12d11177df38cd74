"""Prefill chunks sized by a time budget per round: a long arrival is prefilled in pieces
that fit the budget while a stream decodes, and every output still equals solo decoding."""

import subprocess
import sys

import pytest

from gmlx.config import EngineConfig
from gmlx.drafters import make_drafter
from gmlx.engine import Engine
from gmlx.request import SamplingParams
from gmlx.spec import admission
from schedules import SoloReference
from serving_support import REPO_ROOT, repo_env


@pytest.fixture(scope="module")
def reference(builtin_target):
    return SoloReference(builtin_target)


# "auto" follows measured round times, so only its outputs are checked; under a budget below the
# least a chunk is taken to cost every chunk runs over, so sizes halve down to the minimum on any CPU.
@pytest.mark.parametrize("budget_s, is_chunk_bounded", [(None, False), (admission.MIN_PACKED_CHUNK_S / 2, True)])
@pytest.mark.parametrize("is_packed", [False, True])
def test_a_long_arrival_is_prefilled_within_the_budget(builtin_target, reference, code_prompts, budget_s,
                                                       is_chunk_bounded, is_packed):
    engine = Engine(builtin_target, make_drafter("mtp", builtin_target),
                    EngineConfig(prefill_budget_s=budget_s, is_prefill_packed=is_packed))
    long_prompt = [t for p in code_prompts for t in p][:600]
    prompts = {"A": code_prompts[3], "B": long_prompt}
    params = {"A": SamplingParams(max_tokens=80), "B": SamplingParams(max_tokens=10, temperature=0.7, seed=2)}
    engine.add_request(prompts["A"], params["A"], request_id="A")
    got = {"A": [], "B": []}
    chunk_sizes = []
    for step in range(100_000):
        if step == 3:
            engine.add_request(prompts["B"], params["B"], request_id="B")
        # Only while A decodes: with nobody decoding, a whole chunk stalls no one.
        before = engine.requests["B"].num_prefilled if "B" in engine.requests and "A" in engine.requests else None
        for output in engine.step():
            got[output.request_id].extend(output.new_token_ids)
        if before is not None and "B" in engine.requests and engine.requests["B"].num_prefilled > before:
            chunk_sizes.append(engine.requests["B"].num_prefilled - before)
        if not engine.has_unfinished():
            break
    assert chunk_sizes
    if is_chunk_bounded:  # sized by time, not the fixed chunk
        assert max(chunk_sizes) < engine.config.prefill_chunk_tokens, chunk_sizes
        assert all(b <= a for a, b in zip(chunk_sizes, chunk_sizes[1:])), chunk_sizes  # each over budget: halves
        assert chunk_sizes[-2] == admission.MIN_CHUNK_TOKENS, chunk_sizes
    for request_id in got:
        assert got[request_id] == reference.tokens(prompts[request_id], params[request_id])[0]


def test_serve_refuses_a_malformed_budget():
    cmd = [sys.executable, "-m", "workers.cli_serve", "--prefill-budget-ms", "soon"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=repo_env(), cwd=REPO_ROOT)
    assert out.returncode == 2 and "--prefill-budget-ms" in out.stderr


@pytest.mark.parametrize("is_packed", [False, True])
def test_a_prompt_prefilled_beside_running_rows_joins_one_step_later(builtin_target, reference, code_prompts,
                                                                     is_packed):
    # A step pays either a prefill chunk or the cache merge on top of its round, never both.
    # Packed, the chunk rides the round's forward; its first token is read the step after, and
    # it joins the step after that.
    engine = Engine(builtin_target, None, EngineConfig(is_prefill_packed=is_packed))
    params = {"A": SamplingParams(max_tokens=40), "B": SamplingParams(max_tokens=20, temperature=0.7, seed=5)}
    prompts = {"A": code_prompts[0], "B": code_prompts[1]}
    engine.add_request(prompts["A"], params["A"], request_id="A")
    got = {"A": [], "B": []}
    for _ in range(2):
        for output in engine.step():
            got[output.request_id].extend(output.new_token_ids)
    engine.add_request(prompts["B"], params["B"], request_id="B")
    if is_packed:
        for output in engine.step():
            got[output.request_id].extend(output.new_token_ids)
        assert not got["B"] and engine.counters["num_packed_chunks"] == 1
    for expected_width in (1, 2):
        for output in engine.step():
            got[output.request_id].extend(output.new_token_ids)
        assert got["B"], "the first token goes out in the step that read the prefill's last forward"
        assert engine.batch.num_rows == expected_width
    while engine.has_unfinished():
        for output in engine.step():
            got[output.request_id].extend(output.new_token_ids)
    for request_id in got:
        assert got[request_id] == reference.tokens(prompts[request_id], params[request_id])[0]
