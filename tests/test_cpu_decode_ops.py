"""gmlx's CPU decode ops (RoPE, RMSNorm): each row's bits independent of the rows and
threads sharing the call, close to mx.fast's ops, swapped in at load on quantized models."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gmlx.config import env_overrides
from gmlx.models.loader import load_model
from gmlx.platform import cpu_kernels
from gmlx.platform.cpu_decode_ops import KernelRMSNorm, KernelRoPE, use_cpu_decode_ops

pytestmark = pytest.mark.skipif(
    not cpu_kernels.is_built(), reason=f"gmlx CPU kernels not built: {cpu_kernels.status()['reason']}")

PROPERTY_SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture
def ext():
    """The extension, with its thread count restored after the test."""
    ext = cpu_kernels.extension()
    num_threads = ext.num_threads()
    yield ext
    ext.set_num_threads(num_threads)


def bitwise_equal(a: mx.array, b: mx.array) -> bool:
    return mx.array_equal(a, b).item()


# ------------------------------------------------------------------------------ RoPE

rope_cases = st.fixed_dictionaries({
    "num_rows": st.integers(1, 16),
    "num_heads": st.integers(1, 4),
    "num_new": st.integers(1, 16),
    "head_dim": st.sampled_from([16, 32, 64, 80]),
    "rotated_share": st.sampled_from([1.0, 0.5]),
    "traditional": st.booleans(),
    "base": st.sampled_from([10000.0, 100000.0, 1e6]),
    "scale": st.sampled_from([1.0, 0.25]),
    "seed": st.integers(0, 2**16),
})


def rope_inputs(case):
    key_x, key_offsets = mx.random.split(mx.random.key(case["seed"]))
    shape = (case["num_rows"], case["num_new"], case["num_heads"], case["head_dim"])
    x = 4.0 * mx.random.normal(shape, key=key_x).transpose(0, 2, 1, 3)  # (B, H, T, D), mlx-lm's strided view
    offsets = mx.random.randint(0, 3000, (case["num_rows"],), key=key_offsets).astype(mx.int32)  # ragged rows
    dims = int(case["head_dim"] * case["rotated_share"])
    return x, offsets, (dims, case["traditional"], case["base"], case["scale"])


@PROPERTY_SETTINGS
@given(case=rope_cases)
def test_rope_rows_are_independent_of_row_count_threads_and_verify_width(case, ext):
    x, offsets, args = rope_inputs(case)
    together = {}
    for num_threads in (1, 2):
        ext.set_num_threads(num_threads)
        together[num_threads] = cpu_kernels.rope(x, *args, offsets)
        mx.eval(together[num_threads])
    assert bitwise_equal(together[1], together[2])
    for row in range(case["num_rows"]):
        alone = cpu_kernels.rope(x[row : row + 1], *args, offsets[row : row + 1])
        assert bitwise_equal(alone, together[1][row : row + 1]), row
        # A verify's position t gets what a one-position step at offset + t gets.
        t = case["num_new"] - 1
        step = cpu_kernels.rope(x[row : row + 1, :, t : t + 1], *args, offsets[row : row + 1] + t)
        assert bitwise_equal(step, together[1][row : row + 1, :, t : t + 1]), (row, t)


@PROPERTY_SETTINGS
@given(case=rope_cases)
def test_rope_is_close_to_mlx(case):
    x, offsets, (dims, traditional, base, scale) = rope_inputs(case)
    expected = mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offsets)
    got = cpu_kernels.rope(x, dims, traditional, base, scale, offsets)
    # mlx's float32 angles drift by ~position * 2^-24 radians; the kernel's are exact to float.
    assert mx.allclose(got, expected, rtol=1e-4, atol=2e-3).item()
    scalar = cpu_kernels.rope(x, dims, traditional, base, scale, mx.array(5, dtype=mx.int32))
    assert mx.allclose(scalar, mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=5),
                       rtol=1e-4, atol=1e-4).item()


def test_prefill_sized_rope_spreads_over_threads_with_the_same_bits(ext):
    x = mx.random.normal((2, 3, 700, 64), key=mx.random.key(3))  # (B, H, T, D): many pool chunks
    offsets = mx.array([0, 41], dtype=mx.int32)
    results = []
    for num_threads in (1, 2):
        ext.set_num_threads(num_threads)
        results.append(cpu_kernels.rope(x, 64, False, 10000.0, 1.0, offsets))
        mx.eval(results[-1])
    assert bitwise_equal(*results)
    assert bitwise_equal(results[0][1:, :, 5:6], cpu_kernels.rope(x[1:, :, 5:6], 64, False, 10000.0, 1.0, offsets[1:] + 5))


def test_rope_refuses_bad_arguments():
    x = mx.zeros((2, 1, 3, 8))
    with pytest.raises(ValueError, match="dims 7"):
        cpu_kernels.rope(x, 7, False, 10000.0, 1.0, mx.array(0, dtype=mx.int32))
    with pytest.raises(ValueError, match="offset"):
        cpu_kernels.rope(x, 8, False, 10000.0, 1.0, mx.array([0, 1, 2], dtype=mx.int32))


def test_swap_covers_plain_and_compiled_modules_and_keeps_subclasses():
    from gmlx.platform.cpu_graph import fuse_cpu_ops

    class ScaledRoPE(nn.RoPE):  # a subclass may change the arithmetic: left alone
        pass

    model = nn.Sequential(nn.RoPE(16), ScaledRoPE(16), nn.RMSNorm(24), nn.RMSNorm(24))
    fuse_cpu_ops(model)  # the compiled forms
    model.layers[3] = nn.RMSNorm(24)  # and a plain one
    assert use_cpu_decode_ops(model) == 3
    assert [type(m) for m in model.layers] == [KernelRoPE, ScaledRoPE, KernelRMSNorm, KernelRMSNorm]


# ------------------------------------------------------------------------------ RMSNorm

norm_cases = st.fixed_dictionaries({
    "num_rows": st.integers(1, 16),
    "num_features": st.sampled_from([16, 37, 64, 576, 1024]),
    "eps": st.sampled_from([1e-5, 1e-6]),
    "seed": st.integers(0, 2**16),
})


@PROPERTY_SETTINGS
@given(case=norm_cases)
def test_rms_norm_rows_are_independent_of_row_count_and_threads_and_close_to_mlx(case, ext):
    key_x, key_w = mx.random.split(mx.random.key(case["seed"]))
    x = 6.0 * mx.random.normal((case["num_rows"], 1, case["num_features"]), key=key_x)  # (B, T, D)
    weight = mx.random.normal((case["num_features"],), key=key_w)
    together = {}
    for num_threads in (1, 2):
        ext.set_num_threads(num_threads)
        together[num_threads] = cpu_kernels.rms_norm(x, weight, case["eps"])
        mx.eval(together[num_threads])
    assert bitwise_equal(together[1], together[2])
    for row in range(case["num_rows"]):
        assert bitwise_equal(cpu_kernels.rms_norm(x[row : row + 1], weight, case["eps"]), together[1][row : row + 1])
    expected = mx.fast.rms_norm(x, weight, case["eps"])
    assert mx.allclose(together[1], expected, rtol=1e-5, atol=1e-5).item()


def test_prefill_sized_rms_norm_spreads_over_threads_with_the_same_bits(ext):
    x = mx.random.normal((3, 300, 576), key=mx.random.key(4))  # (B, T, D): many pool chunks
    weight = mx.random.normal((576,), key=mx.random.key(5))
    results = []
    for num_threads in (1, 2):
        ext.set_num_threads(num_threads)
        results.append(cpu_kernels.rms_norm(x, weight, 1e-5))
        mx.eval(results[-1])
    assert bitwise_equal(*results)
    assert bitwise_equal(results[0][2:, 7:8], cpu_kernels.rms_norm(x[2:, 7:8], weight, 1e-5))
    strided = x.transpose(1, 0, 2)  # (T, B, D) view: copied to rows first
    assert bitwise_equal(cpu_kernels.rms_norm(strided, weight, 1e-5), results[0].transpose(1, 0, 2))


def test_rms_norm_refuses_a_mismatched_weight():
    with pytest.raises(ValueError, match="weight"):
        cpu_kernels.rms_norm(mx.zeros((2, 8)), mx.ones((7,)), 1e-5)


# ------------------------------------------------------------------------------ loading


def test_quantized_models_get_the_ops_and_float32_ones_keep_mlx_bits(tiny_quantized_target, tiny_llama_dir):
    kinds = (KernelRoPE, KernelRMSNorm)
    swapped = [type(m) for m in tiny_quantized_target.model.modules() if type(m) in kinds]
    assert swapped.count(KernelRoPE) == 2 and swapped.count(KernelRMSNorm) == 2 * 2 + 1  # per layer; final norm
    float32 = load_model(str(tiny_llama_dir))
    assert not any(type(m) in kinds for m in float32.model.modules())
    with env_overrides({"GMLX_CPU_KERNELS": "0", "GMLX_CPU_COMPUTE_FORMAT": "quantized"}):
        off = load_model(tiny_quantized_target.path)
    assert not any(type(m) in kinds for m in off.model.modules())
