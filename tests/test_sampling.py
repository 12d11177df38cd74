"""Seeded per-position sampling: deterministic noise, exact filters, the right distribution."""

import mlx.core as mx
import numpy as np
import pytest

from gmlx.request import SamplingParams
from gmlx.sampling import SamplingRows, gumbel_noise, sample


def rows_for(*params, seeds=None):
    return SamplingRows.make(list(params), seeds or list(range(len(params))))


def test_noise_depends_only_on_seed_and_position():
    seeds = mx.array([5, 5, 6, 2**40 + 5], dtype=mx.uint64)
    noise = gumbel_noise(seeds, mx.array([9, 10, 9, 9]), 64)
    alone = gumbel_noise(mx.array([5], dtype=mx.uint64), mx.array([9]), 64)
    assert mx.array_equal(noise[0], alone[0])
    for a, b in [(0, 1), (0, 2), (0, 3)]:
        assert not mx.array_equal(noise[a], noise[b])


def test_greedy_rows_take_the_argmax_and_sampled_rows_differ_by_seed():
    logits = mx.random.normal((3, 4, 50), key=mx.random.key(1))
    positions = mx.arange(12).reshape(3, 4)
    rows = rows_for(SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=1.0),
                    seeds=[0, 1, 2])
    tokens = sample(logits, rows, positions)
    assert mx.array_equal(tokens[0], mx.argmax(logits[0], axis=-1))
    again = sample(logits, rows, positions)
    assert mx.array_equal(tokens, again)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, top_k=1),
                                    SamplingParams(temperature=0.7, top_p=1e-6),
                                    SamplingParams(temperature=0.7, min_p=0.999)])
def test_filters_that_keep_one_token_are_greedy(params):
    logits = mx.random.normal((1, 32, 100), key=mx.random.key(2))
    tokens = sample(logits, rows_for(params), mx.arange(32)[None])
    assert mx.array_equal(tokens[0], mx.argmax(logits[0], axis=-1))


def test_top_k_keeps_sampled_tokens_inside_the_top_k():
    logits = mx.random.normal((1, 200, 100), key=mx.random.key(3))
    tokens = sample(logits, rows_for(SamplingParams(temperature=2.0, top_k=5)), mx.arange(200)[None])
    top5 = mx.argsort(-logits[0], axis=-1)[:, :5]
    assert mx.all(mx.any(top5 == tokens[0][:, None], axis=-1)).item()


def test_sampled_frequencies_follow_the_softmax():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    num_draws = 4000
    logits = mx.broadcast_to(mx.array(np.log(probs), dtype=mx.float32), (1, num_draws, 4))
    tokens = sample(logits, rows_for(SamplingParams(temperature=1.0), seeds=[11]), mx.arange(num_draws)[None])
    freq = np.bincount(np.array(tokens[0]), minlength=4) / num_draws
    assert np.abs(freq - probs).max() < 0.03, freq


def test_top_p_drops_the_tail():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    num_draws = 2000
    logits = mx.broadcast_to(mx.array(np.log(probs), dtype=mx.float32), (1, num_draws, 4))
    params = SamplingParams(temperature=1.0, top_p=0.8)
    tokens = sample(logits, rows_for(params, seeds=[12]), mx.arange(num_draws)[None])
    freq = np.bincount(np.array(tokens[0]), minlength=4) / num_draws
    assert freq[2] == 0 and freq[3] == 0
    assert abs(freq[0] - 0.5 / 0.8) < 0.04, freq
