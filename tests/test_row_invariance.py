"""Row invariance (the GPU rules, gmlx/platform/row_invariance.py) run on the CPU: fixed-row
products and one-query attention compute what mlx's own ops compute, and the engine with both
on still gives every stream its plain decoding. Whether they fix a GPU's bits is measured on
one (scripts/row_bits_probe.py, scripts/cuda_bench.sh, BENCHMARKS.md); here mlx's CPU ops are row-invariant already."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from gmlx.cache.ragged import RaggedKVCache
from gmlx.config import EngineConfig, env_overrides, validate_settings
from gmlx.drafters import make_drafter
from gmlx.engine import Engine
from gmlx.models.loader import load_model
from gmlx.platform import row_invariance
from gmlx.platform.row_invariance import attend_each_query_alone, attend_one_query_a_call, in_fixed_blocks
from gmlx.request import SamplingParams
from schedules import SoloReference, check_schedule, make_schedule

# mlx's own ops on the CPU (gmlx's kernels, fused ops and weight layouts off), rules on or off.
_MLX_OPS = {"GMLX_CPU_KERNELS": "0", "GMLX_FUSE_CPU_OPS": "0", "GMLX_INPUT_MAJOR_WEIGHTS": "0"}


def _load(mode: str, attention: str = "masked"):
    with env_overrides({**_MLX_OPS, "GMLX_ROW_INVARIANCE": mode, "GMLX_PRODUCT_BLOCK_ROWS": "8",
                        "GMLX_ROW_ATTENTION": attention}):
        return load_model(None)


@pytest.fixture(scope="module", params=["masked", "unmasked"])
def invariant_target(request):
    return _load("1", request.param)


@pytest.fixture(scope="module")
def mlx_ops_target():
    return _load("0")


@pytest.mark.parametrize("num_rows", [1, 7, 8, 9, 20])
def test_fixed_blocks_compute_the_product(num_rows):
    weight = mx.random.normal((48, 40), key=mx.random.key(num_rows))
    x = mx.random.normal((2, num_rows, 40), key=mx.random.key(100 + num_rows))
    calls = []

    def product(block):
        calls.append(block.shape)
        return block @ weight.T

    y = in_fixed_blocks(product, x, 8)
    assert y.shape == (2, num_rows, 48)
    assert all(shape == (8, 40) for shape in calls), calls  # every call on exactly 8 rows
    assert len(calls) == -(-2 * num_rows // 8)
    np.testing.assert_allclose(np.array(y), np.array(x @ weight.T), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lengths,num_new", [([11], 1), ([8, 8, 8], 4), ([5, 8, 8], 4), ([2, 9], 1)])
def test_one_query_attention_computes_attention(lengths, num_new):
    """Against one call over every query, with the mask a RaggedKVCache builds for rows of these
    lengths before the write (uniform or ragged, one new token or several)."""
    cache = RaggedKVCache(len(lengths))
    cache.lengths = list(lengths)
    mask = cache.make_mask(num_new, return_array=True)  # (B, 1, T, S)
    num_rows, num_keys = len(lengths), mask.shape[-1]
    k, v = (mx.random.normal((num_rows, 2, num_keys, 16), key=mx.random.key(s)) for s in (1, 2))
    queries = mx.random.normal((num_rows, 4, num_new, 16), key=mx.random.key(4))
    want = mx.fast.scaled_dot_product_attention(queries, k, v, scale=0.25, mask=mask)
    for got in (attend_one_query_a_call(queries, k, v, 0.25, mask),
                attend_each_query_alone(queries, k, v, 0.25, lengths)):
        assert got.shape == want.shape
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,value", [("GMLX_ROW_INVARIANCE", "sometimes"), ("GMLX_PRODUCT_BLOCK_ROWS", "0"),
                                        ("GMLX_ROW_ATTENTION", "masked-ish")])
def test_a_malformed_row_setting_fails_start_up(name, value):
    with env_overrides({name: value}), pytest.raises(ValueError, match=name):
        validate_settings()


def test_the_rules_are_on_where_asked(invariant_target, mlx_ops_target):
    attention = invariant_target.model.model.layers[0].self_attn
    assert attention.is_row_invariant and type(attention.q_proj).__name__ == "BlockRowsLinear"
    assert type(invariant_target.model.model.embed_tokens).__name__.startswith("BlockRows")
    assert not mlx_ops_target.model.model.layers[0].self_attn.is_row_invariant


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="mlx's own ops are row-invariant on the CPU only")
def test_rules_change_no_token_where_mlx_is_invariant(invariant_target, mlx_ops_target, code_prompts):
    on, off = SoloReference(invariant_target), SoloReference(mlx_ops_target)
    for i, prompt in enumerate(code_prompts[:3]):
        params = SamplingParams(max_tokens=24, temperature=0.0 if i < 2 else 0.8, seed=i)
        assert on.tokens(prompt, params) == off.tokens(prompt, params)


@pytest.mark.parametrize("kind", ["mtp", "ngram"])
def test_random_schedules_equal_plain_with_the_rules_on(kind, invariant_target, code_prompts):
    """Verify forwards, batches, packed prefill and transitions through the rules' paths."""
    engine = Engine(invariant_target, make_drafter(kind, invariant_target), EngineConfig())
    reference = SoloReference(invariant_target)
    num_spec_rounds = 0
    for i in range(3):
        schedule = make_schedule(7000 + 10 * len(kind) + i, invariant_target.vocab_size, code_prompts, max_requests=5)
        num_spec_rounds += check_schedule(engine, reference, schedule).counters["num_spec_rounds"]
    assert num_spec_rounds > 0


def test_every_product_and_attention_call_takes_the_rules_shape(invariant_target, code_prompts, monkeypatch):
    """On the CPU the bits cannot show a call that slipped past the rules, so count the calls:
    through batches, verifies and packed prefill, every target product runs on exactly 8 rows,
    every attention call takes its rule's shape, and no body product pads its input."""
    target_modules = {id(m) for _, m in invariant_target.model.named_modules()}
    product_rows, attention_calls = [], []
    linear_call, sdpa = nn.Linear.__call__, mx.fast.scaled_dot_product_attention

    def counting_linear(self, x):
        if id(self) in target_modules:
            product_rows.append(x.shape[0] if x.ndim == 2 else -1)
        return linear_call(self, x)

    def counting_sdpa(queries, keys, values, *, scale, mask=None, **kwargs):
        attention_calls.append((queries.shape[-2], isinstance(mask, mx.array), queries.shape[0]))
        return sdpa(queries, keys, values, scale=scale, mask=mask, **kwargs)

    head = invariant_target.model.model.embed_tokens
    padded_elsewhere = []  # (module, rows) for products whose input was not whole blocks
    blocks = row_invariance.in_fixed_blocks

    def counting_blocks(product, x, block_rows):
        num_rows = x.size // x.shape[-1]
        if num_rows % block_rows and product.__self__ is not head:
            padded_elsewhere.append((type(product.__self__).__name__, num_rows))
        return blocks(product, x, block_rows)

    monkeypatch.setattr(nn.Linear, "__call__", counting_linear)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", counting_sdpa)
    monkeypatch.setattr(row_invariance, "in_fixed_blocks", counting_blocks)
    engine = Engine(invariant_target, make_drafter("ngram", invariant_target), EngineConfig())  # no model drafts
    schedule = make_schedule(7100, invariant_target.vocab_size, code_prompts, max_requests=5)
    result = check_schedule(engine, SoloReference(invariant_target), schedule)
    assert result.counters["num_spec_rounds"] > 0
    assert product_rows and set(product_rows) == {8}
    if invariant_target.model.model.row_rules.attention == "masked":  # one query a call, any rows
        assert attention_calls and {call[:2] for call in attention_calls} == {(1, True)}
    else:  # a lone plain step's call: one row, one query, no mask
        assert attention_calls and set(attention_calls) == {(1, False, 1)}
    # The body pads each forward's tokens to whole blocks once; only the tied head pads its own.
    assert not padded_elsewhere, padded_elsewhere[:5]
