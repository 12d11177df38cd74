"""Linear weights stored input-major on the CPU backend: moved at load, bit-identical."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from gmlx.config import BUILTIN_MTP_DIR, env_overrides
from gmlx.platform.cpu_layout import store_weights_input_major
from gmlx.models.loader import load_model
from gmlx.models.mtp_head import load_mtp_head
from gmlx.platform import blas

pytestmark = pytest.mark.skipif(
    mx.default_device() != mx.cpu or not blas.describe_blas(measure=False)["is_interposer_active"],
    reason="the CPU backend with the interposer active",
)


def test_the_interposer_routes_input_major_products():
    # Calibrated and self-checked at load: one row, and 2-8 rows where x @ W.T routes.
    assert blas.routes_input_major()


def linear_weights(model) -> list:
    return [m.weight for _, m in model.named_modules() if type(m) is nn.Linear]


def is_input_major(weight: mx.array) -> bool:
    stored = np.array(weight, copy=False)
    return stored.flags["F_CONTIGUOUS"] and not stored.flags["C_CONTIGUOUS"]


@pytest.mark.parametrize("which", ["blas_builtin_target", "blas_tiny_target"])
def test_loaded_weights_are_input_major_and_bit_identical(which, request, mlx_lm_reference):
    """A prefill, then chunks of 1-8 positions (decode, verify widths) on a growing cache."""
    target = request.getfixturevalue(which)
    weights = linear_weights(target.model)
    assert weights and all(is_input_major(w) for w in weights)
    reference = mlx_lm_reference(target.path)
    assert not any(is_input_major(w) for w in linear_weights(reference))
    rng = np.random.default_rng(5)
    for _ in range(3):
        caches = [make_prompt_cache(target.model), make_prompt_cache(reference)]
        num_positions = int(rng.integers(9, 40))
        for step in range(8):
            tokens = mx.array(rng.integers(0, target.vocab_size, (1, num_positions)))
            ours, plain = (m(tokens, cache=c) for m, c in zip((target.model, reference), caches))
            assert mx.array_equal(ours, plain).item(), (step, num_positions)
            num_positions = int(rng.integers(1, blas.MAX_ROUTED_ROWS + 1))


def test_mtp_head_loads_input_major_and_bit_identical():
    head = load_mtp_head(BUILTIN_MTP_DIR)
    with env_overrides({"GMLX_INPUT_MAJOR_WEIGHTS": "0"}):
        plain = load_mtp_head(BUILTIN_MTP_DIR)
    assert all(is_input_major(w) for w in linear_weights(head))
    assert not any(is_input_major(w) for w in linear_weights(plain))
    dim = head.fuse_proj.weight.shape[0]
    embed = nn.Embedding(128, dim)
    rng = np.random.default_rng(6)
    for num_rows in (1, 3, 8):  # a decode row, a few rows, a drafting batch
        hidden = mx.array(rng.standard_normal((num_rows, 1, dim), dtype=np.float32))
        tokens = mx.array(rng.integers(0, 128, (num_rows, 1)))
        assert mx.array_equal(head(hidden, tokens, embed), plain(hidden, tokens, embed)).item(), num_rows


def test_switched_off_keeps_mlx_lm_layout(tiny_llama_dir):
    with env_overrides({"GMLX_INPUT_MAJOR_WEIGHTS": "0", "GMLX_CPU_FLOAT_KERNELS": "0"}):
        target = load_model(tiny_llama_dir)
    weights = linear_weights(target.model)
    assert weights and not any(is_input_major(w) for w in weights)


def test_nothing_moves_without_routing():
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 32, bias=False))
    before = linear_weights(model)
    blas.set_routing(False)
    try:
        assert store_weights_input_major(model) == 0
    finally:
        blas.set_routing(True)
    assert all(a is b for a, b in zip(before, linear_weights(model)))


def test_only_plain_float32_linears_move_and_shared_weights_once():
    class Scaled(nn.Linear):  # a subclass may use its weight differently: left alone
        pass

    shared = nn.Linear(48, 48, bias=False)
    twin = nn.Linear(48, 48, bias=False)
    twin.weight = shared.weight
    half = nn.Linear(48, 16)
    half.set_dtype(mx.float16)
    model = nn.Sequential(shared, twin, Scaled(48, 8), half)
    assert store_weights_input_major(model) == 2
    assert is_input_major(shared.weight) and shared.weight is twin.weight
    assert not is_input_major(model.layers[2].weight) and half.weight.dtype == mx.float16
