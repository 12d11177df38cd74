"""vLLM's ignore_eos, min_tokens and stop_token_ids: every loop, width and transition samples and
ends what plain decoding does, and plain decoding does what they say.

The built-in model never samples its EOS (id 0) on its own, so these tests make it likely with a
logit_bias, or stop on tokens its answers hold."""

import pytest

from gmlx.config import EngineConfig
from gmlx.drafters import make_drafter
from gmlx.engine import Engine
from gmlx.request import SamplingParams
from schedules import SoloReference, check_schedule, make_schedule, run_alone

DRAFTERS = ("mtp", "draft", "ngram")


@pytest.fixture(scope="module")
def reference(builtin_target):
    return SoloReference(builtin_target)


@pytest.fixture(scope="module")
def eos(builtin_target) -> int:
    return min(builtin_target.eos_token_ids)


@pytest.mark.parametrize("kind", DRAFTERS)
def test_random_schedules_with_end_tokens_equal_plain(kind, builtin_target, reference, code_prompts, eos):
    # Half the requests stop on their prompt's tokens, hold them back, or ignore a likely EOS.
    engine = Engine(builtin_target, make_drafter(kind, builtin_target), EngineConfig())
    num_asking, num_stopped, num_spec_rounds = 0, 0, 0
    for i in range(8):
        schedule = make_schedule(49_700 + 100 * DRAFTERS.index(kind) + i, builtin_target.vocab_size, code_prompts,
                                 max_requests=8, opt_out_rate=0.2, logprobs_rate=0.2, penalty_rate=0.2,
                                 end_rate=0.5, eos_token_id=eos)
        result = check_schedule(engine, reference, schedule)
        asking = [j for j, a in enumerate(schedule.arrivals) if a.params.stop_token_ids or a.params.min_tokens
                  or a.params.ignore_eos]
        num_asking += len(asking)
        num_stopped += sum(result.finish[j] == "stop" for j in asking)
        num_spec_rounds += result.counters["num_spec_rounds"]
    assert num_asking > 5 and num_stopped > 0 and num_spec_rounds > 0


def test_stochastic_acceptance_with_end_tokens_keeps_greedy_rows_exact(builtin_target, reference, code_prompts,
                                                                        eos):
    engine = Engine(builtin_target, make_drafter("draft", builtin_target), EngineConfig(is_stochastic_acceptance=True))
    for i in range(3):
        check_schedule(engine, reference, make_schedule(49_600 + i, builtin_target.vocab_size, code_prompts,
                                                        max_requests=6, temperatures=(0.0,), end_rate=1.0,
                                                        eos_token_id=eos))
    assert engine.counters["num_accepted"] > 0


@pytest.mark.parametrize("kind", [None, "mtp"])
def test_eos_ends_unless_ignored_and_not_before_min_tokens(kind, builtin_target, code_prompts, eos):
    """With EOS forced by a bias: the answer is empty; ignored, it is all EOS; with min_tokens m,
    it is the m tokens the model likes best besides EOS, then EOS ends it."""
    engine = Engine(builtin_target, make_drafter(kind, builtin_target) if kind else None,
                    EngineConfig(prompt_cache_bytes=0))
    prompt = code_prompts[1]
    forced = {eos: 100.0}
    assert run_alone(engine, prompt, SamplingParams(max_tokens=8, logit_bias=forced))[:2] == ([], "stop")
    assert run_alone(engine, prompt, SamplingParams(max_tokens=8, logit_bias=forced, ignore_eos=True))[:2] == \
        ([eos] * 8, "length")
    without_eos = run_alone(engine, prompt, SamplingParams(max_tokens=5, logit_bias={eos: -100.0}))[0]
    held = run_alone(engine, prompt, SamplingParams(max_tokens=8, logit_bias=forced, min_tokens=5))
    assert held[:2] == (without_eos, "stop")


def test_stop_token_ids_end_the_answer_undelivered_and_min_tokens_holds_them_back(builtin_target, code_prompts):
    engine = Engine(builtin_target, None, EngineConfig(prompt_cache_bytes=0))
    for prompt in code_prompts[:4]:
        plain = run_alone(engine, prompt, SamplingParams(max_tokens=16))[0]
        stop_id = plain[3]
        cut = plain.index(stop_id)
        assert run_alone(engine, prompt, SamplingParams(max_tokens=16, stop_token_ids=(stop_id,)))[:2] == \
            (plain[:cut], "stop")
        tokens, reason, _ = run_alone(engine, prompt, SamplingParams(max_tokens=16, stop_token_ids=[stop_id],
                                                                     min_tokens=cut + 2))
        assert stop_id not in tokens[: cut + 2] and len(tokens) >= cut + 2
        assert reason == "length" or (reason == "stop" and len(tokens) < 16)


@pytest.mark.parametrize("params, message", [
    (dict(min_tokens=-1), r"^min_tokens must be in \[0, max_tokens = 64\]"),
    (dict(min_tokens=65), r"^min_tokens must be in \[0, max_tokens = 64\]"),
    (dict(min_tokens=1.5), "^min_tokens must be an integer"),
    (dict(ignore_eos=1), "^ignore_eos must be true or false"),
    (dict(stop_token_ids=(-1,)), r"^stop_token_ids must hold token ids \(integers >= 0\)"),
    (dict(stop_token_ids=tuple(range(65))), "^stop_token_ids must be a list of at most 64"),
    (dict(stop_token_ids=5), "^stop_token_ids must be a list")])
def test_bad_end_token_fields_are_refused_naming_them(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params).validate()


def test_a_stop_token_outside_the_vocabulary_is_refused_by_the_engine(builtin_target):
    engine = Engine(builtin_target, None, EngineConfig())
    with pytest.raises(ValueError, match=f"^stop_token_ids: {builtin_target.vocab_size} is not a token id"):
        engine.add_request([1, 2], SamplingParams(stop_token_ids=(builtin_target.vocab_size,)))
