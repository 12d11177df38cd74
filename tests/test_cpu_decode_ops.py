"""gmlx's CPU decode ops (RoPE, RMSNorm, ragged attention): each row's bits independent of
the rows and threads sharing the call (and, for attention, of how many positions a call
holds), close to mx.fast's ops, swapped in at load on quantized models; whole-engine
identity with them on (speculative and batched equal plain) on a quantized qwen3."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gmlx.config import env_overrides
from gmlx.models.loader import load_model
from gmlx.platform import cpu_kernels
from gmlx.cache.ragged import make_ragged_cache
from gmlx.models.packed import unpacked_class
from gmlx.platform.cpu_attention import _SWAPS as ATTENTION_SWAPS
from gmlx.platform.cpu_decode_ops import _MLP_SWAPS as MLP_SWAPS
from gmlx.platform.cpu_attention import _reference as mlx_ragged_attention
from gmlx.platform.cpu_decode_ops import KernelRMSNorm, KernelRoPE, use_cpu_decode_ops
from kernel_support import (check_schedules_with_drafter, ext, load_quantized_copy, requires_kernels,  # noqa: F401 (ext: a fixture)
                            supported_isas)

pytestmark = requires_kernels

PROPERTY_SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])




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


def rope_float64(x: mx.array, offsets: mx.array, dims: int, traditional: bool, base: float, scale: float):
    """RoPE in float64 from its definition, with the kernel's convention for a position (times
    scale in float32), and each output's angle times its pair's length (what angle drift moves)."""
    xs = np.array(x, dtype=np.float64)  # (B, H, T, D)
    half = dims // 2
    positions = np.array(offsets, dtype=np.int64)[:, None] + np.arange(xs.shape[2])[None, :]
    scaled = (positions.astype(np.float32) * np.float32(scale)).astype(np.float64)  # (B, T)
    angles = scaled[:, None, :, None] * base ** (-np.arange(half) / half)  # (B, 1, T, half)
    # A pair is (2i, 2i + 1) when traditional, else (i, i + half).
    parts = (slice(0, dims, 2), slice(1, dims, 2)) if traditional else (slice(0, half), slice(half, dims))
    first, second = xs[..., parts[0]], xs[..., parts[1]]
    out, drift_scale = xs.copy(), np.zeros_like(xs)
    out[..., parts[0]] = first * np.cos(angles) - second * np.sin(angles)
    out[..., parts[1]] = first * np.sin(angles) + second * np.cos(angles)
    for part in parts:
        drift_scale[..., part] = angles * np.hypot(first, second)
    return out, drift_scale


@PROPERTY_SETTINGS
@given(case=rope_cases)
def test_rope_is_close_to_mlx(case):
    x, offsets, (dims, traditional, base, scale) = rope_inputs(case)
    exact, drift_scale = rope_float64(x, offsets, dims, traditional, base, scale)
    got = cpu_kernels.rope(x, dims, traditional, base, scale, offsets)
    # The kernel's angles are float64 rounded once, so it is float32-close to the definition.
    assert np.abs(np.array(got, dtype=np.float64) - exact).max() <= 2e-5
    # mlx's float32 angles drift by up to ~11 ulps of the angle (2.2e-3 at position ~3000), so
    # each output is held to 32 ulps of its angle times its pair's length: 3x what 600 cases showed.
    expected = mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offsets)
    mlx_bound = 1e-4 + 32 * 2.0**-24 * drift_scale
    assert (np.abs(np.array(got, dtype=np.float64) - np.array(expected, dtype=np.float64)) <= mlx_bound).all()
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


def test_swiglu_is_close_to_mlx_and_each_value_its_own(ext):
    """Elementwise, one code path: a row alone, a prefill-sized call on one or two threads and
    a strided view give the same bits; within float32 rounding of mlx-lm's swiglu."""
    from mlx_lm.models.activations import swiglu

    gate = 6.0 * mx.random.normal((3, 300, 1536), key=mx.random.key(6))  # (B, T, F): several pool chunks
    up = mx.random.normal((3, 300, 1536), key=mx.random.key(7))
    results = []
    for num_threads in (1, 2):
        ext.set_num_threads(num_threads)
        results.append(cpu_kernels.swiglu(gate, up))
        mx.eval(results[-1])
    assert bitwise_equal(*results)
    assert bitwise_equal(results[0][1:2, 5:6], cpu_kernels.swiglu(gate[1:2, 5:6], up[1:2, 5:6]))
    assert bitwise_equal(cpu_kernels.swiglu(gate.transpose(1, 0, 2), up.transpose(1, 0, 2)),
                         results[0].transpose(1, 0, 2))
    assert mx.allclose(results[0], swiglu(gate, up), rtol=1e-5, atol=1e-6).item()
    for isa in supported_isas(ext):  # exp_fixed's loop built per ISA: the same operations
        ext.set_isa(isa)
        assert bitwise_equal(cpu_kernels.swiglu(gate, up), results[0]), isa
    # Past exp_fixed's range a gate's SiLU is still the gate or zero; NaN stays NaN.
    extreme = mx.array([-1e4, -120.0, -88.5, -87.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 87.0, 88.5, 120.0, 1e4])
    ones = mx.ones_like(extreme)
    assert mx.allclose(cpu_kernels.swiglu(extreme, ones), swiglu(extreme, ones), rtol=1e-6, atol=1e-30).item()
    assert mx.isnan(cpu_kernels.swiglu(mx.array([float("nan")]), mx.array([1.0]))).item()
    with pytest.raises(ValueError, match="one shape"):
        cpu_kernels.swiglu(gate, up[:, :2])


def test_swiglu_edge_values_have_the_portable_bits_on_every_isa(ext):
    """The x86 loop runs exp_fixed eight values at a time: NaN, infinities, signed zeros,
    subnormals, its clamps at -87 and 88 and its rounding edges take the scalar loop's bits,
    in the vector lanes and in the tail alike."""
    import numpy as np

    ln2 = float(np.log(2.0))
    edges = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-45, -1e-45, 1e-38, -1e-38, 87.0, -87.0,
             88.0, -88.0, 87.5, -87.5, 88.7, -88.7, 1e4, -1e4, 0.5 * ln2, -0.5 * ln2, 1.5 * ln2, -1.5 * ln2,
             np.nextafter(np.float32(0.5 * ln2), np.float32(1.0)), 1e-3, -1e-3]
    rng = np.random.default_rng(17)
    gate = np.concatenate([np.array(edges, np.float32), rng.normal(0, 30, 8 * 40 + 5).astype(np.float32)])
    up = rng.normal(0, 2, gate.size).astype(np.float32)
    got = {}
    for isa in supported_isas(ext):
        ext.set_isa(isa)
        for start in (0, 3):  # edges in the eight-value loop, then some in the tail
            y = cpu_kernels.swiglu(mx.array(gate[start:]), mx.array(up[start:]))
            got[isa, start] = np.array(y).view(np.uint32)
    ext.set_isa(ext.best_isa())
    for (isa, start), bits in got.items():
        assert np.array_equal(bits, got["portable", start]), (isa, start)


def test_rms_norm_refuses_a_mismatched_weight():
    with pytest.raises(ValueError, match="weight"):
        cpu_kernels.rms_norm(mx.zeros((2, 8)), mx.ones((7,)), 1e-5)


# ------------------------------------------------------------------------------ attention

attention_cases = st.fixed_dictionaries({
    "num_rows": st.integers(1, 16),
    "heads": st.sampled_from([(1, 1), (4, 4), (4, 2), (9, 3), (8, 1)]),  # (Hq, Hkv): MHA and GQA
    "num_new": st.integers(1, 16),
    "head_dim": st.sampled_from([16, 37, 64, 128]),  # 64 and 128 run compile-time-sized code
    "kv_dtype": st.sampled_from(["float32", "float16"]),  # float16: a GMLX_KV_DTYPE=float16 cache
    "seed": st.integers(0, 2**16),
})


def attention_inputs(case):
    key_q, key_k, key_v, key_offsets = mx.random.split(mx.random.key(case["seed"]), 4)
    num_q_heads, num_kv_heads = case["heads"]
    rows, new, dim = case["num_rows"], case["num_new"], case["head_dim"]
    offsets = mx.random.randint(0, 80, (rows,), key=key_offsets).astype(mx.int32)  # ragged lengths
    capacity = int(offsets.max().item()) + new + 3  # keys past a row's length are never seen
    q = mx.random.normal((rows, num_q_heads, new, dim), key=key_q)  # (B, Hq, T, D)
    kv_dtype = getattr(mx, case.get("kv_dtype", "float32"))
    keys = mx.random.normal((rows, num_kv_heads, capacity, dim), key=key_k).astype(kv_dtype)  # (B, Hkv, S, D)
    values = mx.random.normal((rows, num_kv_heads, capacity, dim), key=key_v).astype(kv_dtype)
    return q, keys, values, offsets, dim**-0.5


def widened(keys, values):
    """The KV as the kernel computes with it: a float16 cache's halves widened exactly."""
    return keys.astype(mx.float32), values.astype(mx.float32)


@PROPERTY_SETTINGS
@given(case=attention_cases)
def test_attention_rows_are_independent_of_row_count_threads_and_verify_width(case, ext):
    q, keys, values, offsets, scale = attention_inputs(case)
    together = {}
    for num_threads in (1, 2):
        ext.set_num_threads(num_threads)
        together[num_threads] = cpu_kernels.ragged_attention(q, keys, values, offsets, scale)  # (B, T, Hq * D)
        mx.eval(together[num_threads])
    assert bitwise_equal(together[1], together[2])
    reference = mlx_ragged_attention(q, *widened(keys, values), offsets, scale)
    assert mx.allclose(together[1], reference, atol=1e-5).item()
    if case["kv_dtype"] == "float16":  # halves widen exactly: the float32 path's bits on the widened copy
        assert bitwise_equal(together[1], cpu_kernels.ragged_attention(q, *widened(keys, values), offsets, scale))
    for isa in supported_isas(ext):  # each ISA's build of the same lane order
        ext.set_isa(isa)
        assert bitwise_equal(cpu_kernels.ragged_attention(q, keys, values, offsets, scale), together[1]), isa
    ext.set_isa(ext.best_isa())
    for row in {0, case["num_rows"] // 2, case["num_rows"] - 1}:
        one = slice(row, row + 1)
        alone = cpu_kernels.ragged_attention(q[one], keys[one], values[one], offsets[one], scale)
        assert bitwise_equal(alone, together[1][one]), row
        for t in {0, case["num_new"] - 1}:  # a verify's position t = a one-position step at offset + t
            step = cpu_kernels.ragged_attention(q[one, :, t : t + 1], keys[one], values[one], offsets[one] + t, scale)
            assert bitwise_equal(step, together[1][one, t : t + 1]), (row, t)


long_prefix_cases = st.fixed_dictionaries({
    "num_rows": st.integers(1, 3),
    "num_kv_heads": st.integers(1, 3),
    "group": st.integers(1, 4),  # q heads per kv head
    "num_new": st.integers(1, 16),
    "num_keys": st.integers(1, 2000),
    "head_dim": st.sampled_from([40, 64, 80, 128]),  # 64 and 128: AVX-512's key-blocked tiles
    "kv_dtype": st.sampled_from(["float32", "float16"]),  # float16: AVX2's tiles on every x86 ISA
    "seed": st.integers(0, 2**16),
})


@PROPERTY_SETTINGS
@given(case=long_prefix_cases)
def test_long_prefix_attention_has_the_portable_bits_on_every_isa_and_thread_count(case, ext):
    key_q, key_k, key_v, key_offsets = mx.random.split(mx.random.key(case["seed"]), 4)
    rows, new, dim = case["num_rows"], case["num_new"], case["head_dim"]
    num_kv_heads, capacity = case["num_kv_heads"], case["num_keys"] + new
    offsets = mx.random.randint(0, case["num_keys"] + 1, (rows,), key=key_offsets).astype(mx.int32)  # ragged
    q = mx.random.normal((rows, num_kv_heads * case["group"], new, dim), key=key_q)  # (B, Hq, T, D)
    # Past each row's last visible key the buffers hold NaN: a kernel that let one in would show it.
    is_seen = (mx.arange(capacity)[None, :] < (offsets + new)[:, None])[:, None, :, None]  # (B, 1, S, 1)
    kv_dtype = getattr(mx, case["kv_dtype"])
    keys = mx.where(is_seen, mx.random.normal((rows, num_kv_heads, capacity, dim), key=key_k), mx.nan).astype(kv_dtype)
    values = mx.where(is_seen, mx.random.normal((rows, num_kv_heads, capacity, dim), key=key_v), mx.nan).astype(kv_dtype)
    scale = dim**-0.5
    ext.set_isa("portable")
    ext.set_num_threads(1)
    expected = cpu_kernels.ragged_attention(q, keys, values, offsets, scale)  # the per-query code
    mx.eval(expected)
    assert not mx.isnan(expected).any().item()
    for isa in supported_isas(ext):
        ext.set_isa(isa)
        for num_threads in (1, 2):  # tiles are planned per thread count
            ext.set_num_threads(num_threads)
            got = cpu_kernels.ragged_attention(q, keys, values, offsets, scale)
            assert bitwise_equal(got, expected), (isa, num_threads)
            if case["kv_dtype"] == "float16":  # AVX-512's float32 tiles against AVX2's float16 ones
                assert bitwise_equal(cpu_kernels.ragged_attention(q, *widened(keys, values), offsets, scale), got)
    ext.set_isa(ext.best_isa())


def test_long_attention_spreads_over_threads_with_the_same_bits(ext):
    case = {"num_rows": 2, "heads": (9, 3), "num_new": 200, "head_dim": 64, "seed": 11}
    q, keys, values, offsets, scale = attention_inputs(case)  # prefill-sized: many pool chunks
    results = []
    for num_threads in (1, 2):
        ext.set_num_threads(num_threads)
        results.append(cpu_kernels.ragged_attention(q, keys, values, offsets, scale))
        mx.eval(results[-1])
    assert bitwise_equal(*results)
    assert mx.allclose(results[0], mlx_ragged_attention(q, keys, values, offsets, scale), atol=1e-5).item()


def test_attention_refuses_mismatched_heads():
    with pytest.raises(ValueError, match="multiple of Hkv"):
        cpu_kernels.ragged_attention(mx.zeros((1, 3, 1, 8)), mx.zeros((1, 2, 4, 8)), mx.zeros((1, 2, 4, 8)),
                                     mx.array([0], dtype=mx.int32), 1.0)


def test_prompt_chunking_does_not_change_a_bit(tiny_quantized_target, code_prompts):
    """With every op row- and width-independent, a prompt prefilled whole or in chunks of
    any size leaves the same logits (what lets a time-budgeted prefill chunk freely)."""
    target = tiny_quantized_target
    prompt = mx.array([code_prompts[1][:40]])  # (1, T)
    results = []
    for chunks in ([40], [1, 16, 23], [17, 3, 20]):
        cache = make_ragged_cache(target.num_layers)
        start = 0
        for size in chunks:
            _, logits = target.forward(prompt[:, start : start + size], cache)
            start += size
        results.append(logits[:, -1])
    assert bitwise_equal(results[0], results[1]) and bitwise_equal(results[0], results[2])


# ------------------------------------------------------------------------------ loading


def test_the_kernels_models_get_the_ops_and_the_blas_path_keeps_mlx_bits(tiny_quantized_target, tiny_target,
                                                                         tiny_llama_dir):
    kinds = (KernelRoPE, KernelRMSNorm, *ATTENTION_SWAPS.values(), *MLP_SWAPS.values())
    swapped = [unpacked_class(type(m)) for m in tiny_quantized_target.model.modules()
               if unpacked_class(type(m)) in kinds]
    assert swapped.count(KernelRoPE) == 2 and swapped.count(KernelRMSNorm) == 2 * 2 + 1  # per layer; final norm
    assert sum(kind in MLP_SWAPS.values() for kind in swapped) == 2
    assert swapped.count(ATTENTION_SWAPS[unpacked_class(type(float32_attention(tiny_llama_dir)))]) == 2
    # float32 on panels (GMLX_CPU_FLOAT_KERNELS) takes the same ops; on the BLAS path it keeps mlx's
    assert sum(unpacked_class(type(m)) in kinds for m in tiny_target.model.modules()) == len(swapped)
    with env_overrides({"GMLX_CPU_FLOAT_KERNELS": "0"}):
        float32 = load_model(str(tiny_llama_dir))
    assert not any(unpacked_class(type(m)) in kinds for m in float32.model.modules())
    for switches in ({"GMLX_CPU_KERNELS": "0"}, {"GMLX_CPU_DECODE_OPS": "0"}):
        with env_overrides({**switches, "GMLX_CPU_COMPUTE_FORMAT": "quantized"}):
            off = load_model(tiny_quantized_target.path)
        assert not any(unpacked_class(type(m)) in kinds for m in off.model.modules()), switches


def test_without_the_extension_the_model_keeps_mlx_ops(monkeypatch):
    """The pure-MLX fallback: no extension (or one built before these ops) swaps nothing."""
    from mlx_lm.models import llama

    from gmlx.models import random_model

    model = random_model.make_random_model(random_model.tiny_config("llama"))
    before = [type(m) for m in model.modules()]
    monkeypatch.setattr(cpu_kernels, "is_built", lambda: False)
    assert use_cpu_decode_ops(model) == 0
    assert [type(m) for m in model.modules()] == before and llama.Attention in before


def float32_attention(folder):
    """The attention module of the folder's model on the float32 BLAS path (mlx-lm's class)."""
    with env_overrides({"GMLX_CPU_FLOAT_KERNELS": "0"}):
        return load_model(str(folder)).model.model.layers[0].self_attn


def make_quantized_target(folder, model_type: str):
    """A tiny random model of `model_type` in 4 bits, loaded with the kernels on."""
    from gmlx.models import random_model

    source = random_model.make_random_model_dir(folder / "float", random_model.tiny_config(model_type))
    config = json.loads((source / "config.json").read_text())
    return load_quantized_copy(random_model.make_random_model(config), config, source, folder / "q4")


@pytest.fixture(scope="module")
def quantized_qwen3(tmp_path_factory):
    """qwen3: q_norm and k_norm in its attention."""
    return make_quantized_target(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2"])  # llama: tiny_quantized_target, tests/test_engine.py
def test_kernel_attention_decodes_like_mlx(model_type, quantized_qwen3, tmp_path):
    target = quantized_qwen3 if model_type == "qwen3" else make_quantized_target(tmp_path, model_type)
    assert all(unpacked_class(type(layer.self_attn)) in ATTENTION_SWAPS.values()
               for layer in target.model.model.layers)
    prompt = mx.array([[(37 * i) % 1000 + 3 for i in range(12)]])  # (1, T)
    cache = make_ragged_cache(target.num_layers)
    target.forward(prompt, cache)
    _, kernel_logits = target.forward(prompt[:, :3], cache)  # a 3-position verify-sized step
    _, mlx_logits = target.forward(mx.concatenate([prompt, prompt[:, :3]], axis=1), None)  # mlx-lm's own attention
    assert mx.allclose(kernel_logits, mlx_logits[:, -3:], rtol=1e-3, atol=1e-3).item()


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_qwen3_speculative_and_batched_equal_plain_with_kernels(kind, quantized_qwen3, code_prompts):
    assert check_schedules_with_drafter(quantized_qwen3, kind, code_prompts, range(700, 703)) > 0


# ------------------------------------------------------------------------------ scaled RoPE (Llama 3, YaRN)

# At base 1000 and head dim 16 three rotary pairs fall between Llama 3's bands (tests/test_gguf.py);
# YaRN's factor 4 makes its rotated features 1.139x.
SCALINGS = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 8.0,
               "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 32.0,
             "beta_slow": 1.0},
}


@pytest.fixture(scope="module", params=sorted(SCALINGS))
def quantized_scaled(request, tmp_path_factory):
    """A tiny llama with a scaled rope, quantized as a GGUF arrives (the fused layers' layout)."""
    from gmlx.models import random_model

    folder = tmp_path_factory.mktemp(request.param)
    config = random_model.tiny_config("llama", rope_theta=1000.0, max_position_embeddings=2048,
                                      rope_scaling=SCALINGS[request.param])
    source = random_model.make_random_model_dir(folder / "float", config)
    return load_quantized_copy(random_model.make_random_model(config), config, source, folder / "q4", is_gguf_like=True)


def scaled_rope_module(kind: str, head_dim: int, base: float):
    from mlx_lm.models.rope_utils import initialize_rope

    return initialize_rope(head_dim, base, False, SCALINGS[kind], 2048)


@pytest.mark.parametrize("kind", sorted(SCALINGS))
@pytest.mark.parametrize("seed", range(4))
def test_scaled_rope_is_close_to_mlx_and_each_row_its_own(kind, seed, ext):
    from gmlx.platform.cpu_decode_ops import rope_constants

    head_dim = (16, 64, 128, 80)[seed]
    module = scaled_rope_module(kind, head_dim, (1000.0, 500000.0, 1e4, 1e6)[seed])
    x = 4.0 * mx.random.normal((3, 5, 2, head_dim), key=mx.random.key(seed)).transpose(0, 2, 1, 3)  # (B, H, T, D)
    offsets = mx.array([3, 700, 2900], dtype=mx.int32)
    args = rope_constants(module)[:4]
    freqs, mscale = rope_constants(module)[4:]
    together = {}
    for num_threads in (1, 2):
        ext.set_num_threads(num_threads)
        together[num_threads] = cpu_kernels.rope(x, *args, offsets, freqs, mscale)
        mx.eval(together[num_threads])
    assert bitwise_equal(together[1], together[2])
    expected = module(x, offset=offsets)
    assert mx.allclose(together[1], expected, rtol=1e-3, atol=1e-3).item()
    assert not mx.allclose(cpu_kernels.rope(x, head_dim, False, 1000.0, 1.0, offsets), expected,
                           rtol=1e-3, atol=1e-3).item()  # the scaling is what changed it
    for row in range(3):
        alone = cpu_kernels.rope(x[row : row + 1], *args, offsets[row : row + 1], freqs, mscale)
        assert bitwise_equal(alone, together[1][row : row + 1]), row


def test_rope_refuses_frequencies_that_do_not_fit():
    x = mx.zeros((2, 1, 3, 8))
    offset = mx.array(0, dtype=mx.int32)
    with pytest.raises(ValueError, match="3 freqs for rope dims 8"):
        cpu_kernels.rope(x, 8, False, 1.0, 1.0, offset, [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="positive"):
        cpu_kernels.rope(x, 8, False, 1.0, 1.0, offset, [1.0, 2.0, 0.0, 4.0])


def test_scaled_rope_layers_run_fused_and_decode_like_mlx_lm(quantized_scaled, mlx_lm_reference):
    from gmlx.platform.cpu_decode_ops import KernelLlama3RoPE, KernelYarnRoPE
    from gmlx.platform.cpu_layers import FusedLlamaBlock

    layers = quantized_scaled.model.model.layers
    assert all(type(layer) is FusedLlamaBlock and type(layer.self_attn.rope) in (KernelLlama3RoPE, KernelYarnRoPE)
               for layer in layers)
    assert quantized_scaled.model.model.__dict__.get("_stack_call") is not None  # every layer in one node a step
    prompt = mx.array([[(37 * i) % 1000 + 3 for i in range(300)]])  # past the original context
    cache = make_ragged_cache(quantized_scaled.num_layers)
    _, logits = quantized_scaled.forward(prompt, cache)
    expected = mlx_lm_reference(quantized_scaled.path)(prompt).astype(mx.float32)  # mlx's own ops and rope
    assert mx.abs(logits[:, -50:] - expected[:, -50:]).max().item() < 0.02 * mx.abs(expected).max().item()


def test_scaled_rope_speculative_and_batched_equal_plain_with_kernels(quantized_scaled, code_prompts):
    assert check_schedules_with_drafter(quantized_scaled, "ngram", code_prompts, range(710, 713)) > 0
