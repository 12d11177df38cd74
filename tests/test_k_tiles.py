"""The K-tile layouts (int8_dot_kernels.h: kK2Bits to kK6Bits): a GGUF's K-quant (Q2_K to Q6_K)
matrices in the tile kernels with their own scales and levels. Products against the triplet tiles'
bits and the exact values, at every row count, thread count and ISA; lookups; refusals; and a
K-quant file served with them: speculative and batched output equal plain decoding."""

import gguf
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gguf_support import random_blocks
from kernel_support import ext  # noqa: F401 (a fixture)
from kernel_support import (TILE_WALK_DRAWS, check_schedules_with_drafter, check_tile_bits_everywhere, gfni_settings,
                            load_tiled_gguf, requires_kernels, supported_isas)
from gmlx.config import env_overrides
from gmlx.models import gguf_blocks
from gmlx.models.loader import load_model
from gmlx.platform import cpu_kernels
from gmlx.platform.cpu_quantized import K_QUANT_BLOCK_BYTES, K_QUANT_BLOCK_VALUES

pytestmark = requires_kernels

Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = (gguf.GGMLQuantizationType[kind] for kind in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"))
BITS = cpu_kernels.K_TILE_KINDS
TRIPLET_BITS = {"Q4_K": 4, "Q5_K": 8}  # the bits of the triplets Q4_K and Q5_K load as



def q4_k_blocks(num_outputs: int, num_inputs: int, seed: int, is_float16_exact: bool, kind: str = "Q4_K") -> np.ndarray:
    """Random Q4_K (or Q5_K) rows (bytes, rows x blocks). is_float16_exact: d and dmin powers of two, so
    every d * sc and dmin * m is a float16 value (the triplet tiles' scales are then the very same)."""
    block_bytes = K_QUANT_BLOCK_BYTES[kind]
    blocks = random_blocks((num_outputs, num_inputs), gguf.GGMLQuantizationType[kind], seed=seed)
    blocks = blocks.reshape(num_outputs, -1, block_bytes)
    if is_float16_exact:
        rng = np.random.default_rng(seed)
        for at in (0, 2):
            power = 2.0 ** rng.integers(-16, -8, blocks.shape[:2])
            blocks[..., at : at + 2] = power.astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(num_outputs, -1)


def exact_values(blocks: np.ndarray, kind: str = "Q4_K") -> np.ndarray:
    """Each Q4_K (or Q5_K) weight as (d * sc) * q + (-dmin * m) in float32, the products exact: what
    a K-tile (K5-tile) holds."""
    rows = blocks.shape[0]
    split = blocks.reshape(rows, -1, K_QUANT_BLOCK_BYTES[kind])
    sub_scales, sub_mins = gguf_blocks._k_scales_and_mins(split[..., 4:16])
    d, dmin = gguf_blocks._half(split, 0).astype(np.float32), gguf_blocks._half(split, 2).astype(np.float32)
    scales, biases = d[..., None] * sub_scales, -dmin[..., None] * sub_mins  # (rows, supers, 8)
    # (rows, supers, 8, 32): Q4_K's nibbles; Q5_K's levels as its triplets hold them, a byte each.
    levels = gguf_blocks._k_levels(split[..., 16:]) if kind == "Q4_K" else gguf_blocks._q5_k(split)[0]
    return (scales[..., None] * levels.astype(np.float32) + biases[..., None]).reshape(rows, -1)


def exact_q6_k_values(blocks: np.ndarray) -> np.ndarray:
    """Each Q6_K weight as (d * sc) * (q - 32) in float32, the product d * sc exact."""
    rows = blocks.shape[0]
    split = blocks.reshape(rows, -1, K_QUANT_BLOCK_BYTES["Q6_K"])
    d = gguf_blocks._half(split, 208).astype(np.float32)  # (rows, supers)
    sub_scales = split[..., 192:208].view(np.int8).astype(np.float32)  # (rows, supers, 16)
    low, high = split[..., :128], split[..., 128:192]
    levels = np.empty((*split.shape[:2], 256), dtype=np.float32)
    for v in range(256):  # q6_k_values' reading of value v
        half, quarter, l = v // 128, v % 128 // 32, v % 32
        nibble = (low[..., 64 * half + 32 * (quarter % 2) + l] >> (0 if quarter < 2 else 4)) & 0x0F
        levels[..., v] = (nibble | (((high[..., 32 * half + l] >> (2 * quarter)) & 3) << 4)).astype(np.float32) - 32
    scales = np.repeat(d[..., None] * sub_scales, 16, axis=-1)  # (rows, supers, 256)
    return (scales * levels).reshape(rows, -1)


# Q3_K and Q2_K: the gguf package's dequantize, (d * sc) * (q - 4) and (d * sc) * q - dmin * m in float32,
# each product exact (4 or 6 bits times float16's 11).
EXACT = {"Q4_K": exact_values, "Q5_K": lambda blocks: exact_values(blocks, "Q5_K"), "Q6_K": exact_q6_k_values,
         "Q3_K": lambda blocks: gguf.quants.dequantize(blocks, Q3_K),
         "Q2_K": lambda blocks: gguf.quants.dequantize(blocks, Q2_K)}


def triplets_of(blocks: np.ndarray, kind: str = "Q4_K") -> tuple[mx.array, mx.array, mx.array]:
    triplets = gguf_blocks.block_triplets("m.weight", kind, blocks)
    return triplets["m.weight"], triplets["m.scales"], triplets["m.biases"]



@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    num_supers=st.integers(1, 6),
    num_rows=st.one_of(st.integers(1, 6), st.integers(7, 24)),
    kind=st.sampled_from(["Q4_K", "Q5_K"]),
    **TILE_WALK_DRAWS,
)
def test_k_tiles_give_the_triplet_tiles_bits_where_their_scales_are_float16(num_supers, num_outputs, num_rows,
                                                                            prefetch_blocks, amx, seed, kind, ext):
    """Where every d * sc and dmin * m is a float16 value, a K-tile (K5-tile) holds the 4-bit (8-bit)
    triplet tiles' very scales and biases: so its products are the int8 path's bits over the
    triplets, at every row, thread count, pool split, ISA and prefetch distance (AMX on or off:
    K-tiles walk on VNNI)."""
    num_inputs = num_supers * K_QUANT_BLOCK_VALUES
    blocks = q4_k_blocks(num_outputs, num_inputs, seed, is_float16_exact=True, kind=kind)
    w, scales, biases = triplets_of(blocks, kind)
    ext.set_tile_layout(True)
    ext.set_amx(int(amx))
    k_tiles = cpu_kernels.pack_k_quant_tiles(blocks, kind)
    assert k_tiles.size == ext.quad_layout_bytes(num_outputs, num_inputs, BITS[kind])
    x = 3.0 * mx.random.normal((num_rows, num_inputs), key=mx.random.key(seed + 1))  # (M, K)
    ext.set_num_threads(1)
    ext.set_isa("portable")
    expected = cpu_kernels.quantized_matmul(x, w, scales, biases, 32, TRIPLET_BITS[kind], int8_activations=True)
    mx.eval(expected)
    ext.set_prefetch_chunks(prefetch_blocks)
    check_tile_bits_everywhere(ext, x, k_tiles, num_outputs, BITS[kind], expected)


def k_quant_blocks(kind: str, num_outputs: int, num_inputs: int, seed: int) -> np.ndarray:
    """Random rows of `kind` with random float16 d (and dmin): products float16 cannot hold."""
    if kind in TRIPLET_BITS:
        return q4_k_blocks(num_outputs, num_inputs, seed, is_float16_exact=False, kind=kind)
    return random_blocks((num_outputs, num_inputs), gguf.GGMLQuantizationType[kind], seed=seed)


@pytest.mark.parametrize("kind", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("num_outputs, num_supers", [(40, 3), (577, 2), (9, 6)])
def test_k_tiles_of_any_scales_are_row_and_isa_independent_and_close_to_the_exact_values(kind, num_outputs, num_supers,
                                                                                        ext):
    """Each row's bits are those of its one-row call on one thread of the portable walk, at every
    row count, thread count and ISA; and within the int8 path's tolerance of x @ the exact values
    (so every level's bits sit where the kernels read them)."""
    num_inputs = num_supers * K_QUANT_BLOCK_VALUES
    blocks = k_quant_blocks(kind, num_outputs, num_inputs, num_outputs)
    ext.set_tile_layout(True)
    k_tiles = cpu_kernels.pack_k_quant_tiles(blocks, kind)
    assert k_tiles.size == ext.quad_layout_bytes(num_outputs, num_inputs, BITS[kind])
    x = 3.0 * mx.random.normal((19, num_inputs), key=mx.random.key(num_inputs))
    ext.set_num_threads(1)
    ext.set_isa("portable")
    expected = mx.concatenate([cpu_kernels.quantized_matmul_quads(x[r : r + 1], k_tiles, num_outputs, BITS[kind])
                               for r in range(19)])
    mx.eval(expected)
    assert cpu_kernels.is_close_to(expected, x @ mx.array(EXACT[kind](blocks)).T, cpu_kernels.INT8_ACTIVATIONS_RTOL)
    for num_threads in (1, 2):
        ext.set_num_threads(num_threads)
        for isa in supported_isas(ext):
            ext.set_isa(isa)
            for gfni in gfni_settings(ext):
                ext.set_gfni(gfni)
                for num_rows in (1, 2, 4, 5, 16, 19):
                    got = cpu_kernels.quantized_matmul_quads(x[:num_rows], k_tiles, num_outputs, BITS[kind])
                    assert mx.array_equal(got, expected[:num_rows]).item(), (num_threads, isa, gfni, num_rows)


@pytest.mark.parametrize("kind", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_k_tile_lookups_are_the_exact_values(kind, ext):
    """A K-tile row looked up (a tied head's embedding) is the type's value with its scale products
    exact (Q4_K, Q5_K, Q2_K: (d * sc) * q + (-dmin * m); Q6_K: (d * sc) * (q - 32); Q3_K: (d * sc) * (q - 4));
    the gguf package's dequantize agrees to float32's rounding."""
    blocks = k_quant_blocks(kind, 37, 512, seed=3)
    ext.set_tile_layout(True)
    k_tiles = cpu_kernels.pack_k_quant_tiles(blocks, kind)
    ids = mx.array([[0, 36, 5], [17, 17, 99]])
    got = cpu_kernels.lookup_quads(k_tiles, ids, 37, 512, BITS[kind])
    exact = EXACT[kind](blocks)
    expected = np.where(np.array(ids)[..., None] < 37, exact[np.minimum(np.array(ids), 36)], 0.0)
    assert got.dtype == mx.float32 and np.array_equal(np.array(got), expected.astype(np.float32))
    package = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind])
    assert np.allclose(exact, package, rtol=0, atol=2.0**-20 * np.abs(package).max())


def test_k_tiles_are_refused_outside_the_tile_layout_and_for_bytes_that_are_not_k_quant_rows(ext):
    blocks = q4_k_blocks(16, 256, seed=1, is_float16_exact=False)
    ext.set_tile_layout(False)
    with pytest.raises(ValueError, match="need the tile layout"):
        cpu_kernels.pack_k_quant_tiles(blocks, "Q4_K")
    assert cpu_kernels.k_tile_bits("Q4_K") is None
    ext.set_tile_layout(True)
    assert cpu_kernels.k_tile_bits("IQ2_XS") is None
    k_tiles = cpu_kernels.pack_k_quant_tiles(blocks, "Q4_K")
    x = mx.ones((1, 256))
    ext.set_tile_layout(False)
    with pytest.raises(ValueError, match=f"bits {cpu_kernels.K4_BITS}: expected 4, 8 or"):
        cpu_kernels.quantized_matmul_quads(x, k_tiles, 16, cpu_kernels.K4_BITS)
    ext.set_tile_layout(True)
    with pytest.raises(ValueError, match=r"\(rows, 144 x blocks\) uint8 for Q4_K"):
        cpu_kernels.pack_k_quant_tiles(np.zeros((2, 145), dtype=np.uint8), "Q4_K")
    with pytest.raises(ValueError, match=r"\(rows, 210 x blocks\) uint8 for Q6_K"):
        cpu_kernels.pack_k_quant_tiles(np.zeros((2, 144), dtype=np.uint8), "Q6_K")
    with pytest.raises(ValueError, match=r"\(rows, 176 x blocks\) uint8 for Q5_K"):
        cpu_kernels.pack_k_quant_tiles(np.zeros((2, 144), dtype=np.uint8), "Q5_K")
    with pytest.raises(ValueError, match=r"\(rows, 110 x blocks\) uint8 for Q3_K"):
        cpu_kernels.pack_k_quant_tiles(np.zeros((2, 144), dtype=np.uint8), "Q3_K")
    with pytest.raises(ValueError, match=r"\(rows, 84 x blocks\) uint8 for Q2_K"):
        cpu_kernels.pack_k_quant_tiles(np.zeros((2, 110), dtype=np.uint8), "Q2_K")
    with pytest.raises(ValueError, match="kind IQ2_XS: expected Q2_K, Q3_K, Q4_K, Q5_K or Q6_K"):
        cpu_kernels.pack_k_quant_tiles(np.zeros((2, 74), dtype=np.uint8), "IQ2_XS")
    with pytest.raises(ValueError, match="must be the uint8 layout of 16 outputs x 288 inputs"):
        cpu_kernels.quantized_matmul_quads(mx.ones((1, 288)), k_tiles, 16, cpu_kernels.K4_BITS)
    with pytest.raises(ValueError, match="must be the uint8 layout of 17 outputs x 256 inputs"):
        cpu_kernels.quantized_matmul_quads(x, k_tiles, 17, cpu_kernels.K4_BITS)


@pytest.mark.parametrize("is_own_blocks", [True, False])
def test_a_k_tile_is_probed_against_its_triplets_at_load(is_own_blocks, ext, caplog):
    """A module's K-tiles are packed only where their product matches its own triplets' within the
    int8 path's tolerance (blocks of another matrix are refused by the probe, with a warning)."""
    import mlx.nn as nn

    from gmlx.platform.cpu_quantized import float16_groups, use_cpu_kernels

    blocks = q4_k_blocks(48, 512, seed=5, is_float16_exact=False)
    w, scales, biases = triplets_of(blocks)
    model = nn.Sequential(nn.QuantizedLinear(512, 48, bias=False, group_size=32, bits=4))
    module = model.layers[0]
    module.weight, module.scales, module.biases = w, scales, biases
    halves = float16_groups(model)
    model.set_dtype(mx.float32)
    given = blocks if is_own_blocks else q4_k_blocks(48, 512, seed=6, is_float16_exact=False)
    ext.set_tile_layout(True)
    with env_overrides({"GMLX_CPU_QUANT_ACTIVATIONS": "int8"}):
        assert use_cpu_kernels(model, None, halves, {id(module): (module, "Q4_K", given)}) == 1
    assert module.layout_bits == (cpu_kernels.K4_BITS if is_own_blocks else 4)
    assert ("K-tiles off for Q4_K" in caplog.text) != is_own_blocks


def test_doctor_line_names_the_k_tiles(ext):
    ext.set_tile_layout(True)
    expected = "Q2_K, Q3_K, Q4_K, Q5_K and Q6_K" if ext.has_avx512_vnni() else "Q4_K"
    gfni = "; top bits by GFNI" if ext.is_gfni_enabled() else ""
    assert f"GGUF {expected} as K-tiles (GMLX_CPU_K_TILES{gfni})" in cpu_kernels.format_status(cpu_kernels.status())
    ext.set_gfni(0)
    assert "(GMLX_CPU_K_TILES)" in cpu_kernels.format_status(cpu_kernels.status())
    with env_overrides({"GMLX_CPU_K_TILES": "0"}):
        assert "no K-tiles" in cpu_kernels.format_status(cpu_kernels.status())


# Q6_K among the Q4_K matrices as a Q4_K_M file has them: some layers' v and down, and the output
# head; Q5_K ones, a Q5_K_M file's bulk; Q3_K ones, a Q3_K_M file's; and Q2_K ones, a Q2_K file's.
Q6_K_TENSORS = ("blk.0.ffn_down.weight", "blk.1.attn_v.weight", "output.weight")
Q5_K_TENSORS = ("blk.0.attn_q.weight", "blk.1.ffn_gate.weight", "blk.1.ffn_down.weight")
Q3_K_TENSORS = ("blk.0.attn_k.weight", "blk.0.ffn_up.weight", "blk.1.attn_output.weight")
Q2_K_TENSORS = ("blk.0.ffn_gate.weight", "blk.1.attn_q.weight")


@pytest.fixture(scope="module")
def k_quant_target(tmp_path_factory):
    """A tiny llama whose matrices are Q2_K to Q6_K (widths multiples of 256), as a GGUF,
    loaded with the tile layout on (Q4_K's K-tiles on any CPU; the others' on VNNI CPUs)."""
    types = {**{name: Q6_K for name in Q6_K_TENSORS}, **{name: Q5_K for name in Q5_K_TENSORS},
             **{name: Q3_K for name in Q3_K_TENSORS}, **{name: Q2_K for name in Q2_K_TENSORS}}
    yield from load_tiled_gguf(tmp_path_factory.mktemp("k_quant"), 11, Q4_K, types)


def test_a_k_quant_file_keeps_its_k_quant_products_in_k_tiles_close_to_their_triplets(k_quant_target, ext):
    """Every Q4_K matrix is a K-tile and (on a VNNI CPU) every Q5_K one a K5-tile, every Q6_K one a
    K6-tile, every Q3_K one a K3-tile and every Q2_K one a K2-tile, the head and the token table
    included, the layers fused; the logits are within 2% of the same file packed from its triplets
    (GMLX_CPU_K_TILES=0 and GMLX_CPU_FIVE_BIT_TILES=0: float16-rounded Q4_K and Q5_K scales, Q5_K's
    levels at 8 bits, Q2_K, Q3_K and Q6_K requantized to 8 bits)."""
    from gmlx.platform.cpu_layers import StackedLlamaModel

    ext.set_tile_layout(True)
    is_vnni = ext.has_avx512_vnni()
    modules = dict(k_quant_target.model.named_modules())
    bits_by_module = {"model.layers.0.mlp.down_proj": cpu_kernels.K6_BITS if is_vnni else 8,
                      "model.layers.1.self_attn.v_proj": cpu_kernels.K6_BITS if is_vnni else 8,
                      "lm_head": cpu_kernels.K6_BITS if is_vnni else 8,
                      "model.layers.0.self_attn.q_proj": cpu_kernels.K5_BITS if is_vnni else 8,
                      "model.layers.1.mlp.gate_proj": cpu_kernels.K5_BITS if is_vnni else 8,
                      "model.layers.1.mlp.down_proj": cpu_kernels.K5_BITS if is_vnni else 8,
                      "model.layers.0.self_attn.k_proj": cpu_kernels.K3_BITS if is_vnni else 8,
                      "model.layers.0.mlp.up_proj": cpu_kernels.K3_BITS if is_vnni else 8,
                      "model.layers.1.self_attn.o_proj": cpu_kernels.K3_BITS if is_vnni else 8,
                      "model.layers.0.mlp.gate_proj": cpu_kernels.K2_BITS if is_vnni else 8,
                      "model.layers.1.self_attn.q_proj": cpu_kernels.K2_BITS if is_vnni else 8}
    products = {name: m for name, m in modules.items() if hasattr(m, "layout_bits")}
    assert len(products) == 2 * 7 + 2  # the layers', the head and the token table (its lookups read K-tiles)
    assert {name: m.layout_bits for name, m in products.items()} == {
        name: bits_by_module.get(name, cpu_kernels.K4_BITS) for name in products}
    assert type(k_quant_target.model.model) is StackedLlamaModel
    with env_overrides({"GMLX_CPU_K_TILES": "0", "GMLX_CPU_FIVE_BIT_TILES": "0"}):
        triplets = load_model(k_quant_target.path)
    assert {m.layout_bits for _, m in triplets.model.named_modules() if hasattr(m, "layout_bits")} == {4, 8}
    tokens = mx.array([[5, 17, 300, 41, 9, 1000, 77, 3]])
    _, expected = triplets.forward(tokens, None)
    _, got = k_quant_target.forward(tokens, None)
    assert mx.abs(got - expected).max().item() < 0.02 * mx.abs(expected).max().item()


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_speculative_and_batched_equal_plain_in_k_tiles(kind, k_quant_target, code_prompts, ext):
    ext.set_tile_layout(True)  # the setting the target was packed under
    assert check_schedules_with_drafter(k_quant_target, kind, code_prompts, range(700, 704)) > 0
