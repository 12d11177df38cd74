"""gmlx's CPU kernels: the quantized product's layout, row/thread/ISA independence, tolerance
against mlx, and whole-engine identity (speculative and batched equal plain) with them on."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from serving_support import solo
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gmlx import config
from gmlx.cache.ragged import RaggedKVCache
from gmlx.config import EngineConfig, env_overrides
from gmlx.engine import Engine
from gmlx.platform.cpu_quantized import KernelQuantizedEmbedding, KernelQuantizedLinear
from gmlx.models import random_model
from gmlx.models.loader import load_model
from gmlx.platform import cpu_kernels
from gmlx.request import SamplingParams
from kernel_support import check_schedules_with_drafter, ext, requires_kernels, supported_isas  # noqa: F401 (ext: a fixture)
from schedules import SoloReference

pytestmark = requires_kernels



def make_weights(num_outputs, num_inputs, bits, group_size, seed=0):
    weight = mx.random.normal((num_outputs, num_inputs), key=mx.random.key(seed))  # (N, K)
    return mx.quantize(weight, group_size=group_size, bits=bits)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_one_hot_rows_read_mlx_dequantized_weights(bits, group_size, ext):
    """x = e_k picks column k of the dequantized weights: checks packing order and the affine map."""
    num_outputs, num_inputs = 24, 2 * group_size
    w, scales, biases = make_weights(num_outputs, num_inputs, bits, group_size)
    expected = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits).T  # (K, N)
    for isa in supported_isas(ext):
        ext.set_isa(isa)
        for start in range(0, num_inputs, 16):
            x = mx.eye(num_inputs)[start : start + 16]  # (16, K) one-hot rows
            got = cpu_kernels.quantized_matmul(x, w, scales, biases, group_size, bits)
            assert mx.allclose(got, expected[start : start + 16], rtol=1e-6, atol=1e-6).item(), (isa, start)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    bits=st.sampled_from([4, 8]),
    group_size=st.sampled_from([32, 64, 128]),
    num_groups=st.integers(1, 5),
    num_outputs=st.integers(1, 70),
    num_rows=st.integers(1, 16),
    seed=st.integers(0, 2**16),
)
def test_rows_are_independent_of_row_count_threads_and_isa(bits, group_size, num_groups, num_outputs,
                                                           num_rows, seed, ext):
    num_inputs = group_size * num_groups
    w, scales, biases = make_weights(num_outputs, num_inputs, bits, group_size, seed)
    x = 4.0 * mx.random.normal((num_rows, num_inputs), key=mx.random.key(seed + 1))  # (M, K)
    ext.set_num_threads(1)
    ext.set_isa(ext.best_isa())
    full = cpu_kernels.quantized_matmul(x, w, scales, biases, group_size, bits)  # (M, N)
    reference = x @ mx.dequantize(w, scales, biases, group_size=group_size, bits=bits).T
    assert mx.allclose(full, reference, rtol=1e-4, atol=1e-4 * num_inputs).item()
    for num_threads in (1, 2):
        ext.set_num_threads(num_threads)
        for isa in supported_isas(ext):
            ext.set_isa(isa)
            assert mx.array_equal(cpu_kernels.quantized_matmul(x, w, scales, biases, group_size, bits), full).item()
            for row in {0, num_rows // 2, num_rows - 1}:
                # the row alone, and the row last in a shorter call
                alone = cpu_kernels.quantized_matmul(x[row : row + 1], w, scales, biases, group_size, bits)
                assert mx.array_equal(alone, full[row : row + 1]).item(), (num_threads, isa, row)
                tail = cpu_kernels.quantized_matmul(x[: row + 1], w, scales, biases, group_size, bits)
                assert mx.array_equal(tail, full[: row + 1]).item(), (num_threads, isa, row)


@pytest.mark.parametrize("bits", [4, 8])
def test_prefill_sized_calls_give_each_row_its_decode_bits(bits, ext):
    """Rows past 16 (prefill, wide batches) run the same order: each row equals the row alone."""
    w, scales, biases = make_weights(48, 256, bits, 64, seed=5)
    x = mx.random.normal((37, 256), key=mx.random.key(6))  # (M, K)
    full = cpu_kernels.quantized_matmul(x, w, scales, biases, 64, bits)
    for row in (0, 17, 36):
        alone = cpu_kernels.quantized_matmul(x[row : row + 1], w, scales, biases, 64, bits)
        assert mx.array_equal(alone, full[row : row + 1]).item(), row


NEVER = 1 << 30  # panel_min_rows that keeps every call on the few-row kernels


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    bits=st.sampled_from([4, 8]),
    group_size=st.sampled_from([32, 64, 128]),
    num_inputs_in_32s=st.integers(1, 52),  # K up to 1664: several of AVX2's K blocks (768)
    num_outputs=st.integers(1, 80),  # partial tiles (AVX-512 6 wide, AVX2 3) and thread chunks
    num_rows=st.integers(8, 300),  # the panel kernels' default starts at 8
    seed=st.integers(0, 2**16),
)
def test_many_rows_give_each_row_its_one_row_bits(bits, group_size, num_inputs_in_32s, num_outputs, num_rows,
                                                  seed, ext):
    """Wide calls (8+ rows) run the panel kernels: every row equals the row in a 1-row call
    (and the few-row kernels' result at this row count), for both thread counts and ISAs."""
    num_inputs = max(group_size, num_inputs_in_32s * 32 // group_size * group_size)
    w, scales, biases = make_weights(num_outputs, num_inputs, bits, group_size, seed)
    x = 4.0 * mx.random.normal((num_rows, num_inputs), key=mx.random.key(seed + 1))  # (M, K)
    ext.set_num_threads(1)
    ext.set_isa(ext.best_isa())
    ext.set_panel_min_rows(NEVER)
    few_row = cpu_kernels.quantized_matmul(x, w, scales, biases, group_size, bits)  # (M, N)
    mx.eval(few_row)  # now: the kernels read their settings when the graph runs
    ext.set_panel_min_rows(0)
    reference = x @ mx.dequantize(w, scales, biases, group_size=group_size, bits=bits).T
    assert mx.allclose(few_row, reference, rtol=1e-4, atol=1e-4 * num_inputs).item()
    rows = sorted({0, 3, 4, 5, num_rows // 2, num_rows - 2, num_rows - 1})  # around 3- and 4-row tiles
    for num_threads in (1, 2):
        ext.set_num_threads(num_threads)
        for isa in supported_isas(ext):
            ext.set_isa(isa)
            full = cpu_kernels.quantized_matmul(x, w, scales, biases, group_size, bits)
            assert mx.array_equal(full, few_row).item(), (num_threads, isa)
            for row in rows:
                alone = cpu_kernels.quantized_matmul(x[row : row + 1], w, scales, biases, group_size, bits)
                assert mx.array_equal(alone, full[row : row + 1]).item(), (num_threads, isa, row)


@pytest.mark.parametrize("bits", [4, 8])
def test_panel_kernels_forced_on_few_rows_keep_the_bits(bits, ext):
    """The switch row count is a tuning choice only: the panel kernels on 1-16 rows (and on
    a 1-row call) give the few-row kernels' bits."""
    w, scales, biases = make_weights(50, 896, bits, 128, seed=21)
    x = mx.random.normal((16, 896), key=mx.random.key(22))  # (M, K)
    for isa in supported_isas(ext):
        ext.set_isa(isa)
        for num_rows in (1, 2, 5, 16):
            ext.set_panel_min_rows(NEVER)
            few_row = cpu_kernels.quantized_matmul(x[:num_rows], w, scales, biases, 128, bits)
            mx.eval(few_row)  # before the switch moves: settings are read when the graph runs
            ext.set_panel_min_rows(1)
            panel = cpu_kernels.quantized_matmul(x[:num_rows], w, scales, biases, 128, bits)
            assert mx.array_equal(panel, few_row).item(), (isa, num_rows)


@pytest.mark.parametrize("is_yielding_spin", [True, False])
def test_back_to_back_threaded_calls_all_complete(is_yielding_spin, ext):
    """Thousands of small two-thread jobs in a row: a late worker must never touch the next job."""
    ext.set_num_threads(2)
    ext.set_min_pool_macs(0)  # every call a pool job, however small
    ext.set_yielding_spin(is_yielding_spin)
    w, scales, biases = make_weights(64, 64, 4, 32, seed=11)  # 4 chunks of outputs per call
    xs = [mx.random.normal((1, 64), key=mx.random.key(i)) for i in range(8)]
    expected = [cpu_kernels.quantized_matmul(x, w, scales, biases, 32, 4) for x in xs]
    mx.eval(expected)
    num_jobs = ext.num_pool_jobs()
    try:
        for i in range(3000):
            got = cpu_kernels.quantized_matmul(xs[i % 8], w, scales, biases, 32, 4)
            assert mx.array_equal(got, expected[i % 8]).item(), i
    finally:
        ext.set_yielding_spin(True)
    assert ext.num_pool_jobs() - num_jobs >= 3000  # each call went through the pool


def test_decode_attention_over_a_short_context_stays_on_the_caller(ext):
    """The pool is woken for the keys a query sees, not for the KV buffer's capacity: a decode
    step at 8 keys of a 4096-key buffer is no pool job, one at 3000 keys is."""
    ext.set_num_threads(2)
    q = mx.random.normal((1, 9, 1, 64), key=mx.random.key(1))  # (B, Hq, T, D)
    keys, values = (mx.random.normal((1, 3, 4096, 64), key=mx.random.key(k)) for k in (2, 3))
    mx.eval(q, keys, values)
    for seen, expect_pool in ((8, False), (3000, True)):
        num_jobs = ext.num_pool_jobs()
        mx.eval(cpu_kernels.ragged_attention(q, keys, values, mx.array([seen - 1], dtype=mx.int32), 0.125))
        assert (ext.num_pool_jobs() > num_jobs) == expect_pool, seen


def test_leading_dims_and_strided_inputs(ext):
    w, scales, biases = make_weights(40, 128, 4, 32)
    x = mx.random.normal((2, 3, 128), key=mx.random.key(3))  # (B, T, K)
    flat = cpu_kernels.quantized_matmul(x.reshape(6, 128), w, scales, biases, 32, 4)
    assert mx.array_equal(cpu_kernels.quantized_matmul(x, w, scales, biases, 32, 4), flat.reshape(2, 3, 40)).item()
    transposed = mx.random.normal((128, 5), key=mx.random.key(4)).T  # a strided (5, K) view
    expected = cpu_kernels.quantized_matmul(mx.array(transposed.tolist()), w, scales, biases, 32, 4)
    assert mx.array_equal(cpu_kernels.quantized_matmul(transposed, w, scales, biases, 32, 4), expected).item()


@pytest.mark.parametrize("bits, group_size, message", [(3, 32, "bits 3"), (4, 16, "group_size 16")])
def test_unsupported_formats_are_named(bits, group_size, message):
    w, scales, biases = make_weights(8, 64, 4, 32)
    with pytest.raises(ValueError, match=message):
        cpu_kernels.quantized_matmul(mx.zeros((1, 64)), w, scales, biases, group_size, bits)


def test_forcing_an_unknown_isa_is_refused(ext, monkeypatch):
    with pytest.raises(ValueError, match="sse9"):
        ext.set_isa("sse9")
    monkeypatch.setenv("GMLX_CPU_KERNELS_ISA", "sse9")
    with pytest.raises(ValueError, match="GMLX_CPU_KERNELS_ISA='sse9'"):
        config.cpu_kernels_isa()


@pytest.mark.parametrize("name, read, bad", [("GMLX_CPU_TILE_LAYOUT", config.cpu_tile_layout, "tiles"),
                                              ("GMLX_CPU_AMX", config.cpu_amx, "auto")])
def test_kernel_layout_switches_are_read_or_refused(name, read, bad, monkeypatch):
    """Unset, the kernels choose (tiles where the CPU has VNNI; AMX where the CPU and the OS allow
    it); 1 or 0 force; anything else fails start-up naming the setting."""
    monkeypatch.delenv(name, raising=False)
    assert read() is None
    for raw, expected in (("1", True), ("0", False)):
        monkeypatch.setenv(name, raw)
        assert read() is expected
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=f"{name}='{bad}'"):
        read()
    if name == "GMLX_CPU_AMX":  # read at start-up with the other settings
        with pytest.raises(ValueError, match=f"{name}='{bad}'"):
            config.validate_settings()


@pytest.mark.parametrize("bits, num_outputs, num_inputs", [(4, 1536, 576), (4, 40, 1536), (8, 576, 576)])
def test_amx_row_groups_give_the_vnni_bits(bits, num_outputs, num_inputs, ext):
    """A wide product's row groups of 8-16 on AMX (integer block sums from tdpbsud, then the VNNI
    path's float steps): every row count around the groups' edges, both thread counts, the same bits
    as VNNI and as each row alone. Runs where the CPU and the OS allow AMX."""
    if not ext.has_amx():
        pytest.skip("no AMX-INT8 here (or the OS does not grant its state)")
    ext.set_isa("avx512")
    ext.set_tile_layout(True)
    w, scales, biases = half_exact_weights(num_outputs, num_inputs, bits, 32, seed=num_outputs)
    quads = cpu_kernels.pack_quads(w, scales, biases, 32, bits)
    x = 3.0 * mx.random.normal((40, num_inputs), key=mx.random.key(bits))
    ext.set_amx(1)
    assert ext.is_amx_enabled()
    alone = mx.concatenate([cpu_kernels.quantized_matmul_quads(x[r : r + 1], quads, num_outputs, bits)
                            for r in range(40)])
    for num_threads in (1, 2):
        ext.set_num_threads(num_threads)
        for num_rows in (7, 8, 9, 15, 16, 17, 23, 24, 31, 33, 40):
            got = {}
            for amx in (0, 1):
                ext.set_amx(amx)
                got[amx] = cpu_kernels.quantized_matmul_quads(x[:num_rows], quads, num_outputs, bits)
            assert mx.array_equal(got[1], got[0]).item(), (num_threads, num_rows)
            assert mx.array_equal(got[1], alone[:num_rows]).item(), (num_threads, num_rows)


def test_read_bandwidth_is_positive(ext):
    assert cpu_kernels.read_bandwidth_gbs(16 << 20, 2) > 0.1


# ------------------------------------------------------------- the engine with the kernels on


def num_kernel_modules(target) -> int:
    return sum(type(m) in (KernelQuantizedLinear, KernelQuantizedEmbedding) for _, m in target.model.named_modules())


@pytest.fixture(scope="module")
def mlx_quantized_target(tiny_quantized_target):
    """The same tiny 4-bit folder loaded with the kernels off: products in mlx."""
    with env_overrides({"GMLX_CPU_KERNELS": "0"}):
        return load_model(tiny_quantized_target.path)


def greedy_tokens(engine, prompt, max_tokens=24):
    return solo(engine, prompt, max_tokens=max_tokens)[0]


@pytest.fixture(scope="module")
def float_kernels_target(tiny_quantized_target):
    """The tiny 4-bit folder on the kernels with float activations, whatever the environment says."""
    with env_overrides({"GMLX_CPU_QUANT_ACTIVATIONS": "float"}):
        return load_model(tiny_quantized_target.path)


def test_loaded_quantized_model_uses_kernels_and_decodes_like_mlx(float_kernels_target, mlx_quantized_target,
                                                                  code_prompts):
    assert num_kernel_modules(float_kernels_target) == 2 * 7 + 2  # per layer 7 projections; embed, lm_head
    assert num_kernel_modules(mlx_quantized_target) == 0
    prompt = mx.array([code_prompts[0][:8]])
    hidden_on, logits_on = float_kernels_target.forward(prompt, None)
    hidden_off, logits_off = mlx_quantized_target.forward(prompt, None)
    assert mx.allclose(logits_on, logits_off, rtol=1e-3, atol=1e-3).item()
    kernels = Engine(float_kernels_target, None, EngineConfig(prompt_cache_bytes=0))
    plain = Engine(mlx_quantized_target, None, EngineConfig(prompt_cache_bytes=0))
    for prompt in code_prompts[:6]:
        assert greedy_tokens(kernels, prompt) == greedy_tokens(plain, prompt)


def test_wide_plain_batch_equals_each_row_alone(tiny_quantized_target, code_prompts):
    """20 rows decoding together (more than a verify's 16) give each row its solo tokens."""
    module = tiny_quantized_target.model.model.layers[0].mlp.down_proj
    x = mx.random.normal((20, 1, module.scales.shape[1] * module.group_size), key=mx.random.key(9))  # (B, T, K)
    together = module(x)
    assert all(mx.array_equal(module(x[i : i + 1]), together[i : i + 1]).item() for i in range(20))
    check_rows_decode_as_alone(tiny_quantized_target, code_prompts[:20])


def check_rows_decode_as_alone(target, prompts) -> None:
    """Every prompt decoding in one batch gets the tokens it gets alone."""
    engine = Engine(target, None, EngineConfig(prompt_cache_bytes=0))
    reference = SoloReference(target)
    params = SamplingParams(max_tokens=12)
    ids = {engine.add_request(prompt, params): i for i, prompt in enumerate(prompts)}
    got = {i: [] for i in ids.values()}
    while engine.has_unfinished():
        for output in engine.step():
            got[ids[output.request_id]].extend(output.new_token_ids)
    for i, tokens in got.items():
        assert tokens == reference.tokens(prompts[i], params)[0], i


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_speculative_and_batched_equal_plain_with_kernels(kind, tiny_quantized_target, code_prompts):
    assert check_schedules_with_drafter(tiny_quantized_target, kind, code_prompts, range(500, 506)) > 0


# ------------------------------------------------------------- int8 activations (4- and 8-bit weights)


def int8_activation_reference(x, w, scales, biases, group_size, bits):
    """float64 product of the dequantized weights with x as the int8 path quantizes it: per
    32 inputs d = amax / 127, q = round-half-even(x * (127 / amax)) (numpy, float32 steps)."""
    x = np.array(x, dtype=np.float32)  # (M, K)
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    inverse = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint(blocks * inverse), -127, 127)
    x_quantized = (q * (amax / np.float32(127)).astype(np.float32)).reshape(x.shape).astype(np.float64)
    weight = np.array(mx.dequantize(w, scales, biases, group_size=group_size, bits=bits), dtype=np.float64)
    return x_quantized @ weight.T  # (M, N)


def quantization_error_bound(x, w, scales, biases, group_size, bits):
    """Per output, the most that rounding x to int8 per 32 inputs can move it: each input moves
    by at most amax / 254 of its block. (M, N)"""
    x = np.abs(np.array(x, dtype=np.float64))  # (M, K)
    half_steps = np.repeat(x.reshape(x.shape[0], -1, 32).max(axis=-1) / 254, 32, axis=-1)  # (M, K)
    weight = np.abs(np.array(mx.dequantize(w, scales, biases, group_size=group_size, bits=bits), dtype=np.float64))
    return half_steps @ weight.T


def relative_max_error(got, expected) -> float:
    got, expected = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    return float(np.abs(got - expected).max() / max(np.abs(expected).max(), 1e-30))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    bits=st.sampled_from([4, 8]),
    group_size=st.sampled_from([32, 64, 128]),
    num_inputs_in_32s=st.integers(1, 52),  # K not a multiple of 128 leaves a partial last chunk
    num_outputs=st.integers(1, 70),  # partial groups of 4 outputs and of 16-output thread chunks
    num_rows=st.one_of(st.integers(1, 16), st.integers(8, 120)),
    seed=st.integers(0, 2**16),
)
def test_int8_activation_rows_are_independent_of_row_count_threads_and_isa(bits, group_size, num_inputs_in_32s,
                                                                           num_outputs, num_rows, seed, ext):
    num_inputs = max(group_size, num_inputs_in_32s * 32 // group_size * group_size)
    w, scales, biases = make_weights(num_outputs, num_inputs, bits, group_size, seed)
    x = 4.0 * mx.random.normal((num_rows, num_inputs), key=mx.random.key(seed + 1))  # (M, K)
    ext.set_num_threads(1)
    ext.set_isa("portable")
    full = cpu_kernels.quantized_matmul(x, w, scales, biases, group_size, bits, int8_activations=True)  # (M, N)
    weight = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits)  # (N, K)
    float_scale = np.abs(np.array(x)) @ np.abs(np.array(weight)).T  # (M, N): what float32 rounding scales with
    error = np.abs(np.array(full, dtype=np.float64) - np.array(x @ weight.T, dtype=np.float64))
    assert (error <= 1.001 * quantization_error_bound(x, w, scales, biases, group_size, bits)
            + 1e-5 * float_scale).all()
    emulated = int8_activation_reference(x, w, scales, biases, group_size, bits)
    assert (np.abs(np.array(full, dtype=np.float64) - emulated) <= 1e-5 * float_scale).all()
    rows = sorted({0, num_rows // 2, num_rows - 1})
    for num_threads in (1, 2):
        ext.set_num_threads(num_threads)
        for isa in supported_isas(ext):
            ext.set_isa(isa)
            got = cpu_kernels.quantized_matmul(x, w, scales, biases, group_size, bits, int8_activations=True)
            assert mx.array_equal(got, full).item(), (num_threads, isa)
            for row in rows:
                alone = cpu_kernels.quantized_matmul(x[row : row + 1], w, scales, biases, group_size, bits,
                                                     int8_activations=True)
                assert mx.array_equal(alone, full[row : row + 1]).item(), (num_threads, isa, row)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int8_activations_are_exact_for_integer_rows(bits, group_size, ext):
    """x of integers with |x| reaching 127 in every 32 quantizes without error (d = 1), so the
    product is the float64 one up to float32 rounding: checks packing, lanes and the bias term."""
    num_inputs = 4 * group_size + (32 if group_size == 32 else 0)  # a partial last chunk at group 32
    w, scales, biases = make_weights(24, num_inputs, bits, group_size, seed=3)
    x = mx.random.randint(-126, 127, (5, num_inputs), key=mx.random.key(4)).astype(mx.float32)
    x[:, ::32] = 127.0  # (M, K): every block's amax 127
    expected = np.array(x, dtype=np.float64) @ np.array(
        mx.dequantize(w, scales, biases, group_size=group_size, bits=bits), dtype=np.float64).T
    for isa in supported_isas(ext):
        ext.set_isa(isa)
        got = cpu_kernels.quantized_matmul(x, w, scales, biases, group_size, bits, int8_activations=True)
        assert relative_max_error(got, expected) <= 1e-6, isa


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("bits", [4, 8])
def test_int8_activations_pass_the_stated_tolerance_on_model_shapes(bits, group_size):
    """The load-time probe's measure (max error over max |reference|) on SmolLM2-like shapes."""
    for num_outputs, num_inputs in ((576, 640), (1536, 640), (576, 1536)):  # K of 576 is no whole 128s
        w, scales, biases = make_weights(num_outputs, num_inputs, bits, group_size, seed=num_inputs)
        x = mx.random.normal((3, num_inputs), key=mx.random.key(num_outputs))  # (M, K)
        got = cpu_kernels.quantized_matmul(x, w, scales, biases, group_size, bits, int8_activations=True)
        reference = x @ mx.dequantize(w, scales, biases, group_size=group_size, bits=bits).T
        assert relative_max_error(got, reference) <= cpu_kernels.INT8_ACTIVATIONS_RTOL / 2, (num_outputs, num_inputs)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int8_activations_read_float16_scales_as_the_same_floats(bits, group_size, ext):
    """Scales and biases a float16 holds exactly (a GGUF's Q4_1 d and m) give the same bits
    passed as float16 (fewer bytes read) as float32, on every ISA, partial chunks included."""
    num_inputs = 4 * group_size + (64 if group_size < 128 else 0)  # a partial last chunk below 128
    w, scales, biases = make_weights(37, num_inputs, bits, group_size, seed=7)
    scales, biases = (a.astype(mx.float16).astype(mx.float32) for a in (scales, biases))  # exact in float16
    x = mx.random.normal((6, num_inputs), key=mx.random.key(8))  # (M, K)
    ext.set_isa("portable")
    expected = cpu_kernels.quantized_matmul(x, w, scales, biases, group_size, bits, int8_activations=True)
    for isa in supported_isas(ext):
        ext.set_isa(isa)
        got = cpu_kernels.quantized_matmul(x, w, scales.astype(mx.float16), biases.astype(mx.float16), group_size,
                                           bits, int8_activations=True)
        assert got.dtype == mx.float32 and mx.array_equal(got, expected).item(), isa


def half_exact_weights(num_outputs, num_inputs, bits, group_size, seed):
    """Quantized weights whose scales and biases float16 holds exactly, in float16 (a GGUF's)."""
    w, scales, biases = make_weights(num_outputs, num_inputs, bits, group_size, seed)
    return w, scales.astype(mx.float16), biases.astype(mx.float16)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    bits=st.sampled_from([4, 8]),
    group_size=st.sampled_from([32, 64, 128]),
    num_inputs_in_32s=st.integers(1, 52),  # partial last chunks
    num_outputs=st.integers(1, 70),  # partial quads and thread chunks
    num_rows=st.one_of(st.integers(1, 6), st.integers(7, 40)),
    prefetch_chunks=st.sampled_from([-1, 0, 1, 8]),
    half_tails=st.booleans(),
    tiles=st.booleans(),
    amx=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_quad_layout_gives_the_plain_rows_bits(bits, group_size, num_inputs_in_32s, num_outputs, num_rows,
                                               prefetch_chunks, half_tails, tiles, amx, seed, ext):
    """The one-stream layout, quads or tiles, is a reordering: every row, thread count, ISA,
    pool split, prefetch distance, last chunk (half or padded whole) and, on a CPU with AMX, row
    groups on AMX or VNNI gives the int8 path's bits over the plain rows."""
    num_inputs = max(group_size, num_inputs_in_32s * 32 // group_size * group_size)
    w, scales, biases = half_exact_weights(num_outputs, num_inputs, bits, group_size, seed)
    ext.set_half_tails(half_tails)
    ext.set_tile_layout(tiles)
    ext.set_amx(int(amx))
    quads = cpu_kernels.pack_quads(w, scales, biases, group_size, bits)
    assert quads.size == ext.quad_layout_bytes(num_outputs, num_inputs, bits)
    x = 3.0 * mx.random.normal((num_rows, num_inputs), key=mx.random.key(seed + 1))  # (M, K)
    ext.set_num_threads(1)
    ext.set_isa("portable")
    expected = cpu_kernels.quantized_matmul(x, w, scales, biases, group_size, bits, int8_activations=True)
    ext.set_prefetch_chunks(prefetch_chunks)
    for num_threads, min_pool_macs in ((1, -1), (2, 0), (2, -1)):
        ext.set_num_threads(num_threads)
        ext.set_min_pool_macs(min_pool_macs)
        for isa in supported_isas(ext):
            ext.set_isa(isa)
            got = cpu_kernels.quantized_matmul_quads(x, quads, num_outputs, bits)
            assert got.shape == (num_rows, num_outputs) and mx.array_equal(got, expected).item(), (num_threads, isa)
            alone = cpu_kernels.quantized_matmul_quads(x[-1:], quads, num_outputs, bits)
            assert mx.array_equal(alone, expected[-1:]).item(), (num_threads, isa)


@pytest.mark.parametrize("half_tails", [True, False])
@pytest.mark.parametrize("num_outputs, num_inputs, group_size", [(576, 576, 32), (44, 1536, 64), (13, 224, 32),
                                                                  (70, 4096, 128)])
def test_many_row_kernel_gives_each_row_the_quad_walks_bits(num_outputs, num_inputs, group_size, half_tails, ext):
    """4-bit quads on AVX2 from many rows take the unpacked-panel kernel: forced from one row, at
    its default and never, on 1 and 2 threads, row counts around its 16-row groups and partial
    8-output tiles all give the portable path's bits (so each row its one-row call's)."""
    if "avx2" not in supported_isas(ext):
        pytest.skip("no AVX2 on this CPU")
    ext.set_half_tails(half_tails)
    ext.set_tile_layout(False)
    w, scales, biases = half_exact_weights(num_outputs, num_inputs, 4, group_size, seed=num_inputs)
    quads = cpu_kernels.pack_quads(w, scales, biases, group_size, 4)
    x = 3.0 * mx.random.normal((70, num_inputs), key=mx.random.key(num_outputs))  # (M, K)
    ext.set_isa("portable")
    ext.set_num_threads(1)
    expected = cpu_kernels.quantized_matmul(x, w, scales, biases, group_size, 4, int8_activations=True)
    mx.eval(expected)
    ext.set_isa("avx2")
    for many_rows_min in (1, 0, NEVER):
        ext.set_many_rows_min(many_rows_min)
        for num_threads in (1, 2):
            ext.set_num_threads(num_threads)
            for num_rows in (1, 15, 16, 17, 33, 70):
                got = cpu_kernels.quantized_matmul_quads(x[:num_rows], quads, num_outputs, 4)
                mx.eval(got)  # before the switch moves: settings are read when the graph runs
                assert mx.array_equal(got, expected[:num_rows]).item(), (many_rows_min, num_threads, num_rows)


@pytest.mark.parametrize("half_tails, tiles", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("bits, group_size, num_inputs", [(4, 32, 128), (4, 32, 576), (4, 128, 384), (8, 32, 576),
                                                         (8, 64, 192), (8, 32, 224)])
def test_quad_layout_lookups_are_the_dequantized_rows(bits, group_size, num_inputs, half_tails, tiles, ext):
    """A tied head kept only in the layout (quads or tiles) still embeds: any ids, the plain
    rows' very floats (a last chunk of 64 inputs half or padded, one of 96 padded)."""
    num_outputs = 53
    ext.set_half_tails(half_tails)
    ext.set_tile_layout(tiles)
    w, scales, biases = half_exact_weights(num_outputs, num_inputs, bits, group_size, seed=4)
    quads = cpu_kernels.pack_quads(w, scales, biases, group_size, bits)
    ids = mx.array([[0, 52, 3], [17, 17, 50]])
    expected = mx.dequantize(w[ids], scales[ids].astype(mx.float32), biases[ids].astype(mx.float32),
                             group_size=group_size, bits=bits)
    got = cpu_kernels.lookup_quads(quads, ids, num_outputs, num_inputs, bits)
    assert got.dtype == mx.float32 and mx.array_equal(got, expected).item()


def test_a_pack_keeps_the_layout_set_when_it_was_called(ext):
    """The packer is a graph node: evaluated after the settings move, it still lays out what was
    set at the call (the kernels read a layout under the setting it was packed under)."""
    w, scales, biases = half_exact_weights(37, 576, 4, 32, seed=2)
    packed = {}
    for tiles, half_tails in ((True, True), (False, True), (False, False)):
        ext.set_tile_layout(tiles)
        ext.set_half_tails(half_tails)
        packed[tiles, half_tails] = cpu_kernels.pack_quads(w, scales, biases, 32, 4)  # not evaluated yet
    ext.set_tile_layout(True)
    ext.set_half_tails(True)
    mx.eval(list(packed.values()))
    for (tiles, half_tails), lazy in packed.items():
        ext.set_tile_layout(tiles)
        ext.set_half_tails(half_tails)
        assert mx.array_equal(lazy, cpu_kernels.pack_quads(w, scales, biases, 32, 4)).item(), (tiles, half_tails)
        ids = mx.array([0, 36])
        expected = mx.dequantize(w[ids], scales[ids].astype(mx.float32), biases[ids].astype(mx.float32),
                                 group_size=32, bits=4)
        assert mx.array_equal(cpu_kernels.lookup_quads(lazy, ids, 37, 576, 4), expected).item(), (tiles, half_tails)
    assert packed[True, True].size != packed[False, True].size != packed[False, False].size


def test_the_packer_refuses_what_it_cannot_lay_out(ext):
    w, scales, biases = half_exact_weights(8, 128, 4, 32, seed=3)
    with pytest.raises(ValueError, match="bits 3: expected 4 or 8"):
        ext.pack_quads(w, scales, biases, 32, 3)
    with pytest.raises(ValueError, match="scales and biases must be float16"):
        ext.pack_quads(w, scales.astype(mx.float32), biases, 32, 4)
    with pytest.raises(ValueError, match="group_size 48"):
        ext.pack_quads(w, scales, biases, 48, 4)


@pytest.mark.parametrize("tiles", [False, True])
def test_quad_layout_of_another_shape_is_refused(tiles, ext):
    ext.set_tile_layout(tiles)
    w, scales, biases = half_exact_weights(12, 128, 4, 32, seed=1)
    quads = cpu_kernels.pack_quads(w, scales, biases, 32, 4)
    with pytest.raises(ValueError, match="quads must be the uint8 layout of 17 outputs x 128 inputs"):
        cpu_kernels.quantized_matmul_quads(mx.ones((1, 128)), quads, 17, 4)
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_kernels.quantized_matmul_quads(mx.ones((1, 100)), quads, 12, 4)


def test_int8_activations_convert_every_finite_float16_scale_alike_on_every_isa(ext):
    """One output per finite float16 value (subnormals included) as its scale and bias: the
    portable path's bit conversion and F16C's give the same products."""
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    halves = halves[np.isfinite(halves)]  # (N,)
    scales = mx.array(halves.reshape(-1, 1))  # (N, 1) float16, one group of 32
    biases = mx.array(halves.reshape(-1, 1))  # same magnitude: neither term hides the other
    w = mx.random.randint(0, 2**32, (halves.size, 4), dtype=mx.uint32, key=mx.random.key(3))  # (N, 32 * 4 / 32)
    x = mx.random.normal((2, 32), key=mx.random.key(4))  # (M, K)
    ext.set_isa("portable")
    expected = cpu_kernels.quantized_matmul(x, w, scales, biases, 32, 4, int8_activations=True)
    for isa in supported_isas(ext):
        ext.set_isa(isa)
        got = cpu_kernels.quantized_matmul(x, w, scales, biases, 32, 4, int8_activations=True)
        assert np.array_equal(np.array(got), np.array(expected), equal_nan=True), isa


@pytest.mark.parametrize("bits", [4, 8])
def test_int8_activations_quantize_odd_rows_alike_on_every_isa(bits, ext):
    """x's quantization (scalar on the portable ISA, vectors elsewhere) on blocks with NaN,
    infinities, zeros, negative zeros, subnormals, exact halves and huge values: the same
    products bit for bit, NaNs where they fall."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(6, 256)).astype(np.float32) * 3  # 8 blocks a row
    x[0, :32] = 0.0
    x[0, 32:64] = -0.0
    x[1, 5] = np.nan
    x[5, [29, 100, 127, 135, 250]] = np.nan  # each block's last vectors too
    x[1, 40] = np.inf
    x[1, 70] = -np.inf
    x[2, :32] = np.float32(1e-42)  # subnormal
    x[2, 32:64] = np.float32(3e38)
    x[3, :32] = np.arange(32, dtype=np.float32) - 15.5  # halves after scaling near the ends
    x[4, 64:96] = 127.0 * np.sign(rng.normal(size=32)).astype(np.float32) / 2
    w, scales, biases = half_exact_weights(40, 256, bits, 32, seed=9)
    ext.set_isa("portable")
    expected = np.array(cpu_kernels.quantized_matmul(mx.array(x), w, scales, biases, 32, bits, int8_activations=True))
    for isa in supported_isas(ext):
        ext.set_isa(isa)
        got = np.array(cpu_kernels.quantized_matmul(mx.array(x), w, scales, biases, 32, bits, int8_activations=True))
        assert np.array_equal(got, expected, equal_nan=True), isa


def test_int8_activations_need_a_known_setting(monkeypatch):
    monkeypatch.setenv("GMLX_CPU_QUANT_ACTIVATIONS", "int4")
    with pytest.raises(ValueError, match="GMLX_CPU_QUANT_ACTIVATIONS='int4'"):
        config.cpu_quant_activations()


def num_int8_modules(target) -> int:
    return sum(getattr(m, "is_int8_activations", False) for _, m in target.model.named_modules())


@pytest.fixture(scope="module")
def int8_quantized_target(tiny_quantized_target):
    """The tiny 4-bit folder loaded with GMLX_CPU_QUANT_ACTIVATIONS=int8."""
    with env_overrides({"GMLX_CPU_QUANT_ACTIVATIONS": "int8"}):
        return load_model(tiny_quantized_target.path)


def test_int8_probe_failure_keeps_the_float_path(tiny_quantized_target, monkeypatch, caplog):
    monkeypatch.setattr(cpu_kernels, "INT8_ACTIVATIONS_RTOL", 1e-9)  # no quantized x is this close
    with env_overrides({"GMLX_CPU_QUANT_ACTIVATIONS": "int8"}):
        target = load_model(tiny_quantized_target.path)
    assert num_kernel_modules(target) == 2 * 7 + 2 and num_int8_modules(target) == 0
    assert "int8 activations off" in caplog.text


def test_int8_model_decodes_close_to_float(int8_quantized_target, float_kernels_target, code_prompts):
    float_target = float_kernels_target
    assert num_int8_modules(int8_quantized_target) == num_kernel_modules(int8_quantized_target) == 2 * 7 + 2
    assert num_int8_modules(float_target) == 0 and num_kernel_modules(float_target) == 2 * 7 + 2
    prompt = mx.array([code_prompts[0][:8]])
    _, logits_int8 = int8_quantized_target.forward(prompt, None)
    _, logits_float = float_target.forward(prompt, None)
    assert not mx.array_equal(logits_int8, logits_float).item()  # the switch changes the numerics
    assert relative_max_error(logits_int8, logits_float) <= 0.05


def test_int8_wide_plain_batch_equals_each_row_alone(int8_quantized_target, code_prompts):
    check_rows_decode_as_alone(int8_quantized_target, code_prompts[:20])


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_speculative_and_batched_equal_plain_with_int8_activations(kind, int8_quantized_target, code_prompts):
    with env_overrides({"GMLX_CPU_QUANT_ACTIVATIONS": "int8"}):  # a draft model loads the same way
        assert check_schedules_with_drafter(int8_quantized_target, kind, code_prompts, range(500, 506)) > 0


@pytest.mark.parametrize("is_quad_layout", [True, False])
@pytest.mark.parametrize("saved_dtype", [mx.float32, mx.float16])
def test_half_exact_scales_are_stored_in_float16_with_the_same_results(is_quad_layout, saved_dtype, tiny_llama_dir,
                                                                        tmp_path):
    """A model whose scales and biases float16 holds exactly (as a GGUF's Q4_1), saved in float32
    or in float16 (kept as they are, not cast and compared), keeps them in float16 under int8
    activations, by default in the one-stream quad layout only: its products and embedding
    lookups give the same bits as the plain float32 rows."""
    import mlx_lm

    model, _ = mlx_lm.load(str(tiny_llama_dir))
    nn.quantize(model, group_size=32, bits=4)
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            m.scales, m.biases = (a.astype(mx.float16).astype(saved_dtype) for a in (m.scales, m.biases))
    folder = tmp_path / "half_exact"
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization": {"group_size": 32, "bits": 4}}))
    random_model.copy_tokenizer(tiny_llama_dir, folder)
    with env_overrides({"GMLX_CPU_QUANT_ACTIVATIONS": "int8", "GMLX_CPU_COMPUTE_FORMAT": "quantized",
                        "GMLX_CPU_QUAD_LAYOUT": "1" if is_quad_layout else "0"}):
        target = load_model(folder)
    stored = {name: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a  # the float32 originals
              for name, a in tree_flatten(model.parameters())}
    kernel_modules = [(n, m) for n, m in target.model.named_modules() if getattr(m, "is_int8_activations", False)]
    assert len(kernel_modules) == 2 * 7 + 2
    if is_quad_layout:
        assert all("quads" in m and "weight" not in m and "scales" not in m for _, m in kernel_modules)
    else:
        assert all("quads" not in m and m.scales.dtype == mx.float16 for _, m in kernel_modules)
    x = mx.random.normal((3, config["hidden_size"]), key=mx.random.key(1))  # (M, K)
    for name, m in kernel_modules:
        if name.endswith("q_proj") or name.endswith("embed_tokens"):
            expected = cpu_kernels.quantized_matmul(x, stored[f"{name}.weight"], stored[f"{name}.scales"],
                                                    stored[f"{name}.biases"], 32, 4, int8_activations=True)
            got = m.as_linear(x) if isinstance(m, nn.QuantizedEmbedding) else m(x)
            assert mx.array_equal(got, expected).item(), name
    embed = target.model.model.embed_tokens
    ids = mx.array([[3, 17, 250]])
    looked_up = embed(ids)
    assert looked_up.dtype == mx.float32
    assert mx.array_equal(looked_up, mx.dequantize(stored["model.embed_tokens.weight"][ids],
                                                   stored["model.embed_tokens.scales"][ids],
                                                   stored["model.embed_tokens.biases"][ids], group_size=32, bits=4)).item()


def test_gguf_like_model_runs_in_the_quad_layout(gguf_like_target):
    """Every product int8 and in the one-stream layout, the 8-bit tied head included; the
    MLPs' gate and up grouped into one node."""
    modules = [m for _, m in gguf_like_target.model.named_modules() if hasattr(m, "is_int8_activations")]
    assert len(modules) == 2 * 7 + 1 and all(m.is_int8_activations and "quads" in m for m in modules)
    assert gguf_like_target.model.model.embed_tokens.bits == 8
    assert all(type(layer.mlp).__name__ == "KernelLlamaMLP" for layer in gguf_like_target.model.model.layers)
    assert all(type(layer).__name__ == "FusedLlamaBlock" for layer in gguf_like_target.model.model.layers)


def test_an_int8_activation_model_stores_its_kv_in_halves_by_default(gguf_like_target, builtin_target, code_prompts):
    """GMLX_KV_DTYPE=auto: the caches the engine makes for a model whose products quantize
    activations to int8 store float16 (its byte count halved); a float32 model's and a pinned
    `model` setting's keep the computed float32."""
    with env_overrides({"GMLX_KV_DTYPE": "model"}):
        pinned = load_model(gguf_like_target.path)
    assert gguf_like_target.kv_dtype == mx.float16 and pinned.kv_dtype is None and builtin_target.kv_dtype is None
    assert 2 * gguf_like_target.kv_bytes_per_token == pinned.kv_bytes_per_token
    for target, expected in ((gguf_like_target, mx.float16), (pinned, mx.float32), (builtin_target, mx.float32)):
        engine = Engine(target, None, EngineConfig())
        engine.add_request(code_prompts[0][:20], SamplingParams(max_tokens=4))
        while engine.batch is None:
            engine.step()
        assert all(c.keys.dtype == c.values.dtype == expected for c in engine.batch.caches)


@pytest.mark.parametrize("tiles", [False, True])
def test_quad_layout_and_grouping_leave_every_logit_bit_alone(tiles, gguf_like_target, code_prompts, ext):
    """The layout (quads or tiles) and the grouped nodes only move bytes and merge calls: the
    same folder loaded with mlx's row layout (GMLX_CPU_QUAD_LAYOUT=0, one node per product)
    gives identical logits."""
    with env_overrides({"GMLX_CPU_QUAD_LAYOUT": "0"}):
        rows_target = load_model(gguf_like_target.path)
    assert not any("quads" in m for _, m in rows_target.model.named_modules())
    ext.set_tile_layout(tiles)  # packed and read under this setting
    layout_target = load_model(gguf_like_target.path)
    for prompt in code_prompts[:4]:
        tokens = mx.array([prompt[:40]])
        for cache in (None, "ragged"):  # mlx-lm's attention, then gmlx's kernel attention over its KV
            caches = [[RaggedKVCache() for _ in range(2)] for _ in range(2)] if cache else [None, None]
            _, expected = rows_target.forward(tokens, caches[0])
            _, got = layout_target.forward(tokens, caches[1])
            assert mx.array_equal(got, expected).item(), cache
            if cache:  # and a decode step after the prompt
                next_token = expected[:, -1:].argmax(-1)
                assert mx.array_equal(layout_target.forward(next_token, caches[1])[1],
                                      rows_target.forward(next_token, caches[0])[1]).item()


def test_gguf_like_wide_plain_batch_equals_each_row_alone(gguf_like_target, code_prompts):
    check_rows_decode_as_alone(gguf_like_target, code_prompts[:20])


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_speculative_and_batched_equal_plain_in_the_quad_layout(kind, gguf_like_target, code_prompts):
    assert check_schedules_with_drafter(gguf_like_target, kind, code_prompts, range(600, 606)) > 0


def test_doctor_line_names_the_layout_and_the_fused_layers(ext):
    ext.set_tile_layout(False)
    assert "one-stream layout as quads, half tail chunks where scales allow" in cpu_kernels.format_status(
        cpu_kernels.status())
    ext.set_tile_layout(True)
    assert "16-output tiles" in cpu_kernels.format_status(cpu_kernels.status())
    ext.set_amx(1)
    assert ("wide products on AMX (GMLX_CPU_AMX)" in cpu_kernels.format_status(cpu_kernels.status())) == ext.has_amx()
    ext.set_amx(0)
    assert ("AMX off (GMLX_CPU_AMX=0)" in cpu_kernels.format_status(cpu_kernels.status())) == ext.has_amx()
    assert "fused llama layers" in cpu_kernels.format_status(cpu_kernels.status())
    ext.set_prefetch_chunks(3)  # the tile prefetch the kernels run with is the one reported
    assert "16-output tiles (GMLX_CPU_TILE_LAYOUT), prefetched 3 blocks ahead" in cpu_kernels.format_status(
        cpu_kernels.status())
    ext.set_prefetch_chunks(0)
    assert "no software prefetch" in cpu_kernels.format_status(cpu_kernels.status())
    ext.set_panel_prefetch_bytes(640)
    assert "float32 products on panels prefetched 640 bytes ahead" in cpu_kernels.format_status(cpu_kernels.status())
    with env_overrides({"GMLX_CPU_QUAD_LAYOUT": "0", "GMLX_CPU_FUSED_LAYERS": "0"}):
        line = cpu_kernels.format_status(cpu_kernels.status())
    assert "row layout" in line and "layers apart" in line


def test_quad_layout_lookups_of_unknown_ids_are_zero_rows_and_bad_ids_are_refused(ext):
    w, scales, biases = half_exact_weights(9, 64, 4, 32, seed=5)
    quads = cpu_kernels.pack_quads(w, scales, biases, 32, 4)
    got = cpu_kernels.lookup_quads(quads, mx.array([9, -1, 2], dtype=mx.int64), 9, 64, 4)
    expected_row = mx.dequantize(w[2:3], scales[2:3].astype(mx.float32), biases[2:3].astype(mx.float32),
                                 group_size=32, bits=4)
    assert mx.array_equal(got[:2], mx.zeros((2, 64))).item() and mx.array_equal(got[2:], expected_row).item()
    with pytest.raises(ValueError, match="quad_rows: ids must be int32, uint32 or int64"):
        cpu_kernels.lookup_quads(quads, mx.array([1.0]), 9, 64, 4)


def test_half_tails_drop_the_padding_of_a_last_chunk_of_64_inputs(ext):
    """SmolLM2's K = 576 is 4.5 chunks: a half chunk (192 bytes a quad at 4 bits) instead of a
    padded whole one (320); a last chunk of 96 inputs stays whole."""
    ext.set_tile_layout(False)
    for half_tails, expected in ((True, 4 * 320 + 192), (False, 5 * 320)):
        ext.set_half_tails(half_tails)
        assert ext.quad_layout_bytes(4, 576, 4) == expected
        assert ext.quad_layout_bytes(4, 608, 4) == 5 * 320


def test_tiles_pad_outputs_to_16_and_inputs_to_nothing(ext):
    """A tile is 16 outputs over 32-input blocks: a block's weights (256 bytes at 4 bits, 512
    at 8) and 16 scales and 16 biases; K = 576 takes 18 blocks, no padded chunk."""
    ext.set_tile_layout(True)
    assert ext.quad_layout_bytes(16, 576, 4) == 18 * (256 + 64)
    assert ext.quad_layout_bytes(17, 576, 4) == 2 * 18 * (256 + 64)
    assert ext.quad_layout_bytes(16, 608, 8) == 19 * (512 + 64)
