"""The K-tile layout (int8_dot_kernels.h: kK4Bits): a GGUF's Q4_K matrices in the tile kernels
with Q4_K's own super-block scales. Its products against the 4-bit tiles' bits and the exact
values, at every row count, thread count and ISA; its lookups; its refusals; and a Q4_K file
served with it: speculative and batched output equal plain decoding."""

import gguf
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gguf_support import random_blocks, write_gguf_from_folder
from kernel_support import check_schedules_with_drafter, ext, requires_kernels, supported_isas  # noqa: F401 (ext: a fixture)
from gmlx.config import env_overrides
from gmlx.models import gguf_blocks
from gmlx.models.loader import load_model
from gmlx.platform import cpu_kernels
from gmlx.platform.cpu_quantized import Q4_K_BLOCK_BYTES, Q4_K_BLOCK_VALUES

pytestmark = requires_kernels

Q4_K = gguf.GGMLQuantizationType.Q4_K


def q4_k_blocks(num_outputs: int, num_inputs: int, seed: int, is_float16_exact: bool) -> np.ndarray:
    """Random Q4_K rows (bytes, rows x blocks). is_float16_exact: d and dmin powers of two, so every
    d * sc and dmin * m is a float16 value (the 4-bit tiles' scales are then the very same)."""
    blocks = random_blocks((num_outputs, num_inputs), Q4_K, seed=seed).reshape(num_outputs, -1, Q4_K_BLOCK_BYTES)
    if is_float16_exact:
        rng = np.random.default_rng(seed)
        for at in (0, 2):
            power = 2.0 ** rng.integers(-16, -8, blocks.shape[:2])
            blocks[..., at : at + 2] = power.astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(num_outputs, -1)


def exact_values(blocks: np.ndarray) -> np.ndarray:
    """Each weight as (d * sc) * q + (-dmin * m) in float32, the products exact: what a K-tile holds."""
    rows = blocks.shape[0]
    split = blocks.reshape(rows, -1, Q4_K_BLOCK_BYTES)
    sub_scales, sub_mins = gguf_blocks._k_scales_and_mins(split[..., 4:16])
    d, dmin = gguf_blocks._half(split, 0).astype(np.float32), gguf_blocks._half(split, 2).astype(np.float32)
    scales, biases = d[..., None] * sub_scales, -dmin[..., None] * sub_mins  # (rows, supers, 8)
    levels = gguf_blocks._k_levels(split[..., 16:]).astype(np.float32)  # (rows, supers, 8, 32)
    return (scales[..., None] * levels + biases[..., None]).reshape(rows, -1)


def triplets_of(blocks: np.ndarray) -> tuple[mx.array, mx.array, mx.array]:
    triplets = gguf_blocks.block_triplets("m.weight", "Q4_K", blocks)
    return triplets["m.weight"], triplets["m.scales"], triplets["m.biases"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    num_supers=st.integers(1, 6),
    num_outputs=st.integers(1, 40),  # partial tiles and thread chunks
    num_rows=st.one_of(st.integers(1, 6), st.integers(7, 24)),
    prefetch_blocks=st.sampled_from([-1, 0, 8]),
    amx=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_k_tiles_give_the_4_bit_tiles_bits_where_their_scales_are_float16(num_supers, num_outputs, num_rows,
                                                                          prefetch_blocks, amx, seed, ext):
    """Where every d * sc and dmin * m is a float16 value, a K-tile holds the 4-bit tiles' very
    scales and biases: so its products are the int8 path's bits over the triplets, at every row,
    thread count, pool split, ISA and prefetch distance (AMX on or off: K-tiles walk on VNNI)."""
    num_inputs = num_supers * Q4_K_BLOCK_VALUES
    blocks = q4_k_blocks(num_outputs, num_inputs, seed, is_float16_exact=True)
    w, scales, biases = triplets_of(blocks)
    ext.set_tile_layout(True)
    ext.set_amx(int(amx))
    k_tiles = cpu_kernels.pack_q4_k_tiles(blocks)
    assert k_tiles.size == ext.quad_layout_bytes(num_outputs, num_inputs, cpu_kernels.K4_BITS)
    x = 3.0 * mx.random.normal((num_rows, num_inputs), key=mx.random.key(seed + 1))  # (M, K)
    ext.set_num_threads(1)
    ext.set_isa("portable")
    expected = cpu_kernels.quantized_matmul(x, w, scales, biases, 32, 4, int8_activations=True)
    mx.eval(expected)
    ext.set_prefetch_chunks(prefetch_blocks)
    for num_threads, min_pool_macs in ((1, -1), (2, 0), (2, -1)):
        ext.set_num_threads(num_threads)
        ext.set_min_pool_macs(min_pool_macs)
        for isa in supported_isas(ext):
            ext.set_isa(isa)
            got = cpu_kernels.quantized_matmul_quads(x, k_tiles, num_outputs, cpu_kernels.K4_BITS)
            assert got.shape == (num_rows, num_outputs) and mx.array_equal(got, expected).item(), (num_threads, isa)
            alone = cpu_kernels.quantized_matmul_quads(x[-1:], k_tiles, num_outputs, cpu_kernels.K4_BITS)
            assert mx.array_equal(alone, expected[-1:]).item(), (num_threads, isa)


@pytest.mark.parametrize("num_outputs, num_supers", [(40, 3), (577, 2), (9, 6)])
def test_k_tiles_of_any_scales_are_row_and_isa_independent_and_close_to_the_exact_values(num_outputs, num_supers,
                                                                                        ext):
    """With random float16 d and dmin (products float16 cannot hold), each row's bits are those of
    its one-row call on one thread of the portable walk, at every row count, thread count and
    ISA; and within the int8 path's tolerance of x @ the exact Q4_K values."""
    num_inputs = num_supers * Q4_K_BLOCK_VALUES
    blocks = q4_k_blocks(num_outputs, num_inputs, num_outputs, is_float16_exact=False)
    ext.set_tile_layout(True)
    k_tiles = cpu_kernels.pack_q4_k_tiles(blocks)
    x = 3.0 * mx.random.normal((19, num_inputs), key=mx.random.key(num_inputs))
    ext.set_num_threads(1)
    ext.set_isa("portable")
    expected = mx.concatenate([cpu_kernels.quantized_matmul_quads(x[r : r + 1], k_tiles, num_outputs,
                                                                  cpu_kernels.K4_BITS) for r in range(19)])
    mx.eval(expected)
    assert cpu_kernels.is_close_to(expected, x @ mx.array(exact_values(blocks)).T, cpu_kernels.INT8_ACTIVATIONS_RTOL)
    for num_threads in (1, 2):
        ext.set_num_threads(num_threads)
        for isa in supported_isas(ext):
            ext.set_isa(isa)
            for num_rows in (1, 2, 4, 5, 16, 19):
                got = cpu_kernels.quantized_matmul_quads(x[:num_rows], k_tiles, num_outputs, cpu_kernels.K4_BITS)
                assert mx.array_equal(got, expected[:num_rows]).item(), (num_threads, isa, num_rows)


def test_k_tile_lookups_are_the_exact_values(ext):
    """A K-tile row looked up (a tied head's embedding) is (d * sc) * q + (-dmin * m), the products
    exact; the gguf package's dequantize agrees to float32's rounding."""
    blocks = q4_k_blocks(37, 512, seed=3, is_float16_exact=False)
    ext.set_tile_layout(True)
    k_tiles = cpu_kernels.pack_q4_k_tiles(blocks)
    ids = mx.array([[0, 36, 5], [17, 17, 99]])
    got = cpu_kernels.lookup_quads(k_tiles, ids, 37, 512, cpu_kernels.K4_BITS)
    exact = exact_values(blocks)
    expected = np.where(np.array(ids)[..., None] < 37, exact[np.minimum(np.array(ids), 36)], 0.0)
    assert got.dtype == mx.float32 and np.array_equal(np.array(got), expected.astype(np.float32))
    package = gguf.quants.dequantize(blocks, Q4_K)
    assert np.allclose(exact, package, rtol=0, atol=2.0**-20 * np.abs(package).max())


def test_k_tiles_are_refused_outside_the_tile_layout_and_for_bytes_that_are_not_q4_k_rows(ext):
    blocks = q4_k_blocks(16, 256, seed=1, is_float16_exact=False)
    ext.set_tile_layout(False)
    with pytest.raises(ValueError, match="needs the tile layout"):
        cpu_kernels.pack_q4_k_tiles(blocks)
    ext.set_tile_layout(True)
    k_tiles = cpu_kernels.pack_q4_k_tiles(blocks)
    x = mx.ones((1, 256))
    ext.set_tile_layout(False)
    with pytest.raises(ValueError, match=f"bits {cpu_kernels.K4_BITS}: expected 4, 8 or"):
        cpu_kernels.quantized_matmul_quads(x, k_tiles, 16, cpu_kernels.K4_BITS)
    ext.set_tile_layout(True)
    with pytest.raises(ValueError, match="rows, 144 x blocks"):
        cpu_kernels.pack_q4_k_tiles(np.zeros((2, 145), dtype=np.uint8))
    with pytest.raises(ValueError, match="must be the uint8 layout of 16 outputs x 288 inputs"):
        cpu_kernels.quantized_matmul_quads(mx.ones((1, 288)), k_tiles, 16, cpu_kernels.K4_BITS)
    with pytest.raises(ValueError, match="must be the uint8 layout of 17 outputs x 256 inputs"):
        cpu_kernels.quantized_matmul_quads(x, k_tiles, 17, cpu_kernels.K4_BITS)


@pytest.fixture(scope="module")
def q4_k_target(tmp_path_factory):
    """A tiny llama whose every matrix is Q4_K (widths multiples of 256), as a GGUF, loaded with the
    tile layout on (K-tiles on any CPU: AVX2 and the portable walk run them too)."""
    from conftest import make_random_model_dir

    tmp = tmp_path_factory.mktemp("q4_k")
    folder = make_random_model_dir(tmp / "folder", seed=11, hidden_size=256, intermediate_size=512, head_dim=64)
    path = write_gguf_from_folder(folder, tmp / "q4_k.gguf", quant_type=Q4_K)
    ext = cpu_kernels.extension()
    was_tiles = ext.tile_layout()
    ext.set_tile_layout(True)
    try:
        yield load_model(path)
    finally:
        ext.set_tile_layout(was_tiles)


def test_a_q4_k_file_keeps_every_q4_k_product_in_k_tiles_close_to_its_float16_triplets(q4_k_target, ext):
    """Every layer product is a K-tile, the layers fused; the logits are within 1% of the same file
    packed from float16-rounded scales (GMLX_CPU_K_TILES=0), which round each scale by up to 2^-11."""
    from gmlx.platform.cpu_layers import StackedLlamaModel

    ext.set_tile_layout(True)
    products = [m for layer in q4_k_target.model.model.layers for _, m in layer.named_modules()
                if hasattr(m, "layout_bits")]
    assert len(products) == 2 * 7 and all(m.layout_bits == cpu_kernels.K4_BITS for m in products)
    assert type(q4_k_target.model.model) is StackedLlamaModel
    with env_overrides({"GMLX_CPU_K_TILES": "0"}):
        rounded = load_model(q4_k_target.path)
    assert not any(getattr(m, "layout_bits", None) == cpu_kernels.K4_BITS for _, m in rounded.model.named_modules())
    tokens = mx.array([[5, 17, 300, 41, 9, 1000, 77, 3]])
    _, expected = rounded.forward(tokens, None)
    _, got = q4_k_target.forward(tokens, None)
    assert mx.abs(got - expected).max().item() < 0.01 * mx.abs(expected).max().item()


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_speculative_and_batched_equal_plain_in_k_tiles(kind, q4_k_target, code_prompts, ext):
    ext.set_tile_layout(True)  # the setting the target was packed under
    assert check_schedules_with_drafter(q4_k_target, kind, code_prompts, range(700, 704)) > 0
