"""OpenAI's presence and frequency penalties and transformers' repetition penalty: every loop,
width and transition samples what plain decoding samples, and plain decoding applies them as
written."""

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
def test_random_schedules_with_penalties_equal_plain(kind, builtin_target, reference, code_prompts):
    # Half the requests penalize (presence, frequency, both, negative), among opt-outs and logprobs.
    engine = Engine(builtin_target, make_drafter(kind, builtin_target), EngineConfig())
    num_penalized, num_spec_rounds = 0, 0
    for i in range(8):
        schedule = make_schedule(46_000 + 100 * DRAFTERS.index(kind) + i, builtin_target.vocab_size, code_prompts,
                                 max_requests=8, opt_out_rate=0.2, logprobs_rate=0.3, penalty_rate=0.5)
        result = check_schedule(engine, reference, schedule)
        num_penalized += sum(a.params.is_penalized for a in schedule.arrivals)
        num_spec_rounds += result.counters["num_spec_rounds"]
    assert num_penalized > 10 and num_spec_rounds > 0


def test_stochastic_acceptance_with_penalties_keeps_greedy_rows_exact(builtin_target, reference, code_prompts):
    engine = Engine(builtin_target, make_drafter("draft", builtin_target), EngineConfig(is_stochastic_acceptance=True))
    for i in range(3):
        check_schedule(engine, reference, make_schedule(47_000 + i, builtin_target.vocab_size, code_prompts,
                                                        max_requests=6, temperatures=(0.0,), penalty_rate=1.0))
    assert engine.counters["num_accepted"] > 0


@pytest.mark.parametrize("presence, frequency", [(2.0, 0.0), (0.0, 1.5), (0.7, 0.4), (-1.0, 0.0)])
def test_greedy_penalized_tokens_are_the_penalized_argmax_of_each_step(presence, frequency, builtin_target,
                                                                        code_prompts):
    """Each greedy token is the argmax of logits - frequency x count - presence x (count > 0) over
    the tokens generated before it, the logits from one forward over prompt and tokens so far."""
    engine = Engine(builtin_target, None, EngineConfig(prompt_cache_bytes=0))
    params = SamplingParams(max_tokens=16, presence_penalty=presence, frequency_penalty=frequency)
    for prompt in code_prompts[:3]:
        tokens, _, _ = run_alone(engine, prompt, params)
        plain, _, _ = run_alone(engine, prompt, SamplingParams(max_tokens=16))
        for step, token in enumerate(tokens):
            _, logits = builtin_target.forward(mx.array([list(prompt) + tokens[:step]]), None)
            row = np.array(logits[0, -1].astype(mx.float32))
            counts = np.bincount(tokens[:step], minlength=row.shape[0]).astype(np.float32)
            penalized = row - frequency * counts - presence * (counts > 0)
            best = int(penalized.argmax())
            assert token == best or penalized[best] - penalized[token] < 1e-3, (step, token, best)
        if presence > 0 or frequency > 0:
            assert len(set(tokens)) >= len(set(plain))  # repeats discouraged


@pytest.mark.parametrize("penalty", [1.3, 0.8, 3.0])
def test_greedy_repetition_penalized_tokens_are_the_penalized_argmax_of_each_step(penalty, builtin_target,
                                                                                    code_prompts):
    """transformers' repetition penalty: each greedy token is the argmax of the logits with every
    token of the prompt and of the answer so far divided by the penalty where positive, else
    multiplied, the logits from one forward over prompt and tokens so far."""
    engine = Engine(builtin_target, None, EngineConfig(prompt_cache_bytes=0))
    params = SamplingParams(max_tokens=16, repetition_penalty=penalty)
    num_changed = 0
    for prompt in code_prompts[:3]:
        tokens, _, _ = run_alone(engine, prompt, params)
        num_changed += tokens != run_alone(engine, prompt, SamplingParams(max_tokens=16))[0]
        for step, token in enumerate(tokens):
            _, logits = builtin_target.forward(mx.array([list(prompt) + tokens[:step]]), None)
            row = np.array(logits[0, -1].astype(mx.float32))
            seen = np.unique(list(prompt) + tokens[:step])
            row[seen] = np.where(row[seen] > 0, row[seen] / np.float32(penalty), row[seen] * np.float32(penalty))
            best = int(row.argmax())
            assert token == best or row[best] - row[token] < 1e-3, (step, token, best)
    assert num_changed > 0


@pytest.mark.parametrize("name, value", [("presence_penalty", 2.5), ("frequency_penalty", -2.01),
                                         ("presence_penalty", float("nan")), ("frequency_penalty", "1"),
                                         ("repetition_penalty", 0.0), ("repetition_penalty", 10.5),
                                         ("repetition_penalty", float("inf"))])
def test_bad_penalties_are_refused_naming_the_field(name, value):
    with pytest.raises(ValueError, match=f"^{name} must"):
        SamplingParams(**{name: value}).validate()
