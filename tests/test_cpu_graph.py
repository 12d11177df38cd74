"""Compiled RMSNorm and RoPE on the CPU backend: swapped in at load, bit-identical."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from gmlx.cache.ragged import concat_layer_caches, make_ragged_cache
from gmlx.config import env_overrides
from gmlx.platform.cpu_graph import FusedRMSNorm, FusedRoPE, fuse_cpu_ops
from gmlx.models.loader import load_model

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="CPU backend only")


def count_types(model) -> dict:
    counts = {}
    for _, module in model.named_modules():
        counts[type(module)] = counts.get(type(module), 0) + 1
    return counts


@pytest.mark.parametrize("which", ["blas_builtin_target", "blas_tiny_target"])
def test_loaded_models_are_fused_and_bit_identical(which, request, mlx_lm_reference):
    target = request.getfixturevalue(which)
    counts = count_types(target.model)
    assert counts.get(FusedRMSNorm, 0) > 0 and counts.get(FusedRoPE, 0) > 0
    assert counts.get(nn.RMSNorm, 0) == 0 and counts.get(nn.RoPE, 0) == 0
    reference = mlx_lm_reference(target.path)
    rng = np.random.default_rng(3)
    for _ in range(3):  # a prefill, then decode steps, through mlx-lm's cache on both sides
        tokens = mx.array(rng.integers(0, target.vocab_size, (1, int(rng.integers(2, 60)))))
        caches = [make_prompt_cache(target.model), make_prompt_cache(reference)]
        for step in range(6):
            fused, plain = (m(tokens, cache=c) for m, c in zip((target.model, reference), caches))
            assert mx.array_equal(fused, plain).item(), step
            tokens = mx.argmax(plain[:, -1:], axis=-1)


def test_ragged_rows_are_bit_identical(blas_builtin_target, mlx_lm_reference):
    """gmlx's own cache: per-row RoPE offsets (an array), rows of different lengths."""
    reference = mlx_lm_reference(blas_builtin_target.path)
    rng = np.random.default_rng(4)
    prompts = [mx.array(rng.integers(0, blas_builtin_target.vocab_size, (1, n))) for n in (5, 19, 33)]
    outputs = []
    for model in (blas_builtin_target.model, reference):
        rows = []
        for prompt in prompts:
            rows.append(make_ragged_cache(blas_builtin_target.num_layers))
            model.model(prompt, cache=rows[-1])
        caches = concat_layer_caches(rows)
        outputs.append([model.model(mx.array([[7], [8], [9]]), cache=caches) for _ in range(3)])
    assert all(mx.array_equal(a, b).item() for a, b in zip(*outputs))


def test_switched_off_leaves_the_model_as_mlx_lm_builds_it(tiny_llama_dir):
    with env_overrides({"GMLX_FUSE_CPU_OPS": "0", "GMLX_CPU_FLOAT_KERNELS": "0"}):
        target = load_model(tiny_llama_dir)
    counts = count_types(target.model)
    assert counts.get(FusedRMSNorm, 0) == 0 and counts.get(nn.RMSNorm, 0) > 0


def test_only_exact_types_are_swapped():
    class ScaledRoPE(nn.RoPE):  # a subclass may change the arithmetic: left alone
        def __call__(self, x, offset=0):
            return super().__call__(x * 2, offset)

    model = nn.Sequential(nn.RMSNorm(16), ScaledRoPE(16), nn.RoPE(16, base=500.0))
    assert fuse_cpu_ops(model) == 2
    assert [type(m) for m in model.layers] == [FusedRMSNorm, ScaledRoPE, FusedRoPE]
