"""OpenAI's logit_bias: every loop, width and transition samples what plain decoding samples, and
plain decoding samples from the raw logits plus the bias."""

import mlx.core as mx
import numpy as np
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


@pytest.mark.parametrize("kind", DRAFTERS)
def test_random_schedules_with_logit_bias_equal_plain(kind, builtin_target, reference, code_prompts):
    # Half the requests ban, damp, boost or force tokens, among penalties, logprobs and opt-outs.
    engine = Engine(builtin_target, make_drafter(kind, builtin_target), EngineConfig())
    num_biased, num_spec_rounds = 0, 0
    for i in range(8):
        schedule = make_schedule(49_000 + 100 * DRAFTERS.index(kind) + i, builtin_target.vocab_size, code_prompts,
                                 max_requests=8, opt_out_rate=0.2, logprobs_rate=0.3, penalty_rate=0.3,
                                 bias_rate=0.5)
        result = check_schedule(engine, reference, schedule)
        num_biased += sum(a.params.logit_bias is not None for a in schedule.arrivals)
        num_spec_rounds += result.counters["num_spec_rounds"]
    assert num_biased > 5 and num_spec_rounds > 0


def test_stochastic_acceptance_with_logit_bias_keeps_greedy_rows_exact(builtin_target, reference, code_prompts):
    engine = Engine(builtin_target, make_drafter("draft", builtin_target), EngineConfig(is_stochastic_acceptance=True))
    for i in range(3):
        check_schedule(engine, reference, make_schedule(49_500 + i, builtin_target.vocab_size, code_prompts,
                                                        max_requests=6, temperatures=(0.0,), bias_rate=1.0))
    assert engine.counters["num_accepted"] > 0


def test_greedy_biased_tokens_are_the_biased_argmax_of_each_step(builtin_target, code_prompts):
    """Each greedy token is the argmax of logits + bias, the logits from one forward over prompt
    and tokens so far; the bias bans the plain answer's first token and boosts another."""
    engine = Engine(builtin_target, None, EngineConfig(prompt_cache_bytes=0))
    for prompt in code_prompts[:3]:
        plain, _, _ = run_alone(engine, prompt, SamplingParams(max_tokens=12))
        boosted = next(t for t in plain + [5] if t != plain[0])
        logit_bias = {plain[0]: -100.0, boosted: 3.0}
        tokens, _, _ = run_alone(engine, prompt, SamplingParams(max_tokens=12, logit_bias=logit_bias))
        assert plain[0] not in tokens and tokens != plain
        bias = np.zeros(builtin_target.vocab_size, dtype=np.float32)
        bias[list(logit_bias)] = list(logit_bias.values())
        for step, token in enumerate(tokens):
            _, logits = builtin_target.forward(mx.array([list(prompt) + tokens[:step]]), None)
            biased = np.array(logits[0, -1].astype(mx.float32)) + bias
            best = int(biased.argmax())
            assert token == best or biased[best] - biased[token] < 1e-3, (step, token, best)


def test_a_forced_token_is_every_token_and_logprobs_stay_the_raw_models(builtin_target, code_prompts):
    engine = Engine(builtin_target, make_drafter("mtp", builtin_target), EngineConfig(prompt_cache_bytes=0))
    prompt = code_prompts[0]
    raw = run_alone(engine, prompt, SamplingParams(max_tokens=6, logprobs=2))
    forced = SamplingParams(max_tokens=6, temperature=0.9, seed=3, logit_bias={7: 100.0}, logprobs=2)
    request_id = engine.add_request(prompt, forced)
    tokens, entries = [], []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == request_id
            tokens += out.new_token_ids
            entries += out.logprobs or ()
    assert tokens == [7] * 6
    # The first position's logprobs are the unbiased model's: the same as a request without bias.
    _, logits = builtin_target.forward(mx.array([list(prompt)]), None)
    row = np.array(logits[0, -1].astype(mx.float32))
    want = row[7] - np.log(np.exp(row - row.max()).sum()) - row.max()
    assert abs(entries[0].logprob - want) < 1e-4 and raw[0]


@pytest.mark.parametrize("logit_bias, message", [
    ({3: 100.5}, r"values in \[-100, 100\]"), ({3: float("nan")}, "finite number"), ({-1: 1.0}, "token ids"),
    ({"3": 1.0}, "token ids"), ({i: 1.0 for i in range(301)}, "at most 300"), (((3, 1.0), (3, 2.0)), "once"),
    ([(3, 1.0)], "map token ids")])
def test_bad_logit_bias_is_refused_naming_the_field(logit_bias, message):
    with pytest.raises(ValueError, match=f"^logit_bias must.*{message}"):
        SamplingParams(logit_bias=logit_bias).validate()


def test_a_token_outside_the_vocabulary_is_refused_by_the_engine(builtin_target):
    engine = Engine(builtin_target, None, EngineConfig())
    with pytest.raises(ValueError, match=f"^logit_bias: {builtin_target.vocab_size} is not a token id"):
        engine.add_request([1, 2], SamplingParams(logit_bias={builtin_target.vocab_size: 1.0}))
