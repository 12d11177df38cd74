"""Float32 products over panels (gmlx/platform/cpu_float.py): a row's bits independent of the
rows, threads, pool split, ISA and prefetch distance of its call, close to the BLAS product, and float32
models swapped at load with their tied token table, near mlx-lm's logits."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from gmlx.cache.ragged import make_ragged_cache
from gmlx.platform import cpu_kernels
from gmlx.platform.cpu_float import KernelEmbedding, KernelLinear, pack_panels, use_float_kernels
from kernel_support import ext, requires_kernels, supported_isas  # noqa: F401 (ext: a fixture)

pytestmark = requires_kernels
# Where the kernels have only their portable loop, float32 models keep the BLAS (cpu_float.py).
requires_vector_isa = pytest.mark.skipif(
    not cpu_kernels.is_built() or cpu_kernels.extension().best_isa() == "portable",
    reason="float32 models stay on the BLAS without AVX2 + FMA")

# |kernel - float64 reference| relative to the largest |reference| of a product (one fma
# chain per output over up to 1,000 random normal terms: ~1e-7 measured).
_REFERENCE_RTOL = 1e-5


@pytest.mark.parametrize("seed", range(4))
def test_each_rows_bits_are_its_own_at_every_row_count_thread_count_isa_and_prefetch(ext, seed):
    rng = np.random.default_rng(seed)
    num_outputs = int(rng.choice([64, 130, 192, 7]))
    num_inputs = int(rng.choice([576, 37, 64, 1000]))
    weight = rng.standard_normal((num_outputs, num_inputs)).astype(np.float32)
    panels = pack_panels(mx.array(weight))
    x = rng.standard_normal((37, num_inputs)).astype(np.float32)
    expected = x.astype(np.float64) @ weight.T.astype(np.float64)
    ext.set_min_pool_macs(0)  # every call on the pool, split by panels
    reference = None
    for isa in supported_isas(ext):
        ext.set_isa(isa)
        for num_threads, prefetch_bytes in ((1, -1), (2, 0), (2, 64 * 13)):
            ext.set_num_threads(num_threads)
            ext.set_panel_prefetch_bytes(prefetch_bytes)  # same bits at any distance, off or the default
            whole = np.array(cpu_kernels.float_matmul(mx.array(x), panels, num_outputs))
            if reference is None:
                reference = whole
                scale = np.abs(expected).max()
                assert np.abs(whole - expected).max() <= _REFERENCE_RTOL * scale
            assert np.array_equal(whole, reference), (isa, num_threads, prefetch_bytes)
            for num_rows in (*range(1, 17), 33):
                start = int(rng.integers(0, 37 - num_rows + 1))
                part = np.array(cpu_kernels.float_matmul(mx.array(x[start : start + num_rows]), panels, num_outputs))
                assert np.array_equal(part, reference[start : start + num_rows]), (isa, num_threads, num_rows,
                                                                                   prefetch_bytes)


def test_bad_panels_are_refused_with_the_layout_named():
    x = mx.zeros((1, 64))
    with pytest.raises(ValueError, match=r"panels must be float32 \(2, 64, 64\)"):
        cpu_kernels.float_matmul(x, mx.zeros((1, 64, 64)), 100)
    with pytest.raises(ValueError, match="panels must be float32"):
        cpu_kernels.float_matmul(x, mx.zeros((2, 64, 64), dtype=mx.float16), 100)
    with pytest.raises(ValueError, match="num_outputs must be positive"):
        cpu_kernels.float_matmul(x, mx.zeros((1, 64, 64)), 0)


@requires_vector_isa
def test_a_swapped_module_keeps_its_weight_only_as_panels_and_a_tied_table_looks_up_its_rows():
    linear, table = nn.Linear(96, 130), nn.Embedding(200, 96)
    model = nn.Sequential(linear, table)
    weight, rows = linear.weight, table.weight
    x = mx.random.normal((2, 3, 96), key=mx.random.key(1))
    expected = x @ weight.T + linear.bias
    assert use_float_kernels(model, head=table) == 2
    assert type(linear) is KernelLinear and type(table) is KernelEmbedding
    assert "weight" not in linear and "weight" not in table and "panels" in repr(linear) and "panels" in repr(table)
    assert cpu_kernels.is_close_to(linear(x), expected, _REFERENCE_RTOL)
    ids = mx.array([[0, 63, 64], [199, 130, 5]])
    assert mx.array_equal(table(ids), rows[ids]).item()
    assert cpu_kernels.is_close_to(table.as_linear(x), x @ rows.T, _REFERENCE_RTOL)


def test_an_untied_token_table_is_left_alone():
    table = nn.Embedding(200, 96)
    assert use_float_kernels(nn.Sequential(table), head=None) == 0
    assert type(table) is nn.Embedding


@requires_vector_isa
@pytest.mark.parametrize("which", ["builtin_target", "tiny_target"])
def test_float32_models_load_on_panels_near_mlx_lms_logits(which, request, mlx_lm_reference):
    """Every linear (and a tied head) swapped; a prefill and decode steps within tolerance of
    mlx-lm's logits, greedy tokens mlx-lm's but at near-ties (the swap's probe bounds each
    product; this bounds the whole model, norms, RoPE and attention kernels included)."""
    target = request.getfixturevalue(which)
    modules = [m for _, m in target.model.named_modules()]
    assert not any(type(m) is nn.Linear for m in modules)
    assert sum(type(m) is KernelLinear for m in modules) >= 4 * target.num_layers
    reference = mlx_lm_reference(target.path)
    rng = np.random.default_rng(8)
    tokens = mx.array(rng.integers(0, target.vocab_size, (1, 29)))
    ours_cache, reference_cache = make_ragged_cache(target.num_layers), make_prompt_cache(reference)
    for step in range(6):
        _, ours = target.forward(tokens, ours_cache)
        plain = reference(tokens, cache=reference_cache)
        scale = mx.abs(plain).max().item()
        assert mx.abs(ours - plain).max().item() <= 1e-3 * scale, step
        ours_top, plain_top = int(mx.argmax(ours[0, -1]).item()), int(mx.argmax(plain[0, -1]).item())
        gap = (plain[0, -1, plain_top] - plain[0, -1, ours_top]).item()
        assert gap <= 1e-3 * scale, (step, gap)  # the same greedy token, or a near-tie in mlx-lm's logits
        tokens = mx.argmax(plain[:, -1:], axis=-1)


def test_switched_off_keeps_the_blas_path(blas_tiny_target):
    """GMLX_CPU_FLOAT_KERNELS=0 (the fixture's load): mlx-lm's modules, the BLAS products."""
    modules = [m for _, m in blas_tiny_target.model.named_modules()]
    assert any(type(m) is nn.Linear for m in modules) and not any(type(m) is KernelLinear for m in modules)

