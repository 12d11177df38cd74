"""The narrow tiles (int8_dot_kernels.h: kFiveBits, kIq4Bits): 8-bit rows whose levels all fit 5 bits
(a GGUF's Q5_0 and Q5_1) or all are IQ4's codebook values (IQ4_NL, IQ4_XS), kept at 5 bits or as
4-bit indices in the tile kernels. Products and lookups against the 8-bit tiles' bits at every row
count, thread count, ISA and GFNI setting; refusals; and a file of such matrices loaded with them:
its logits the 8-bit packing's bit for bit, speculative and batched output equal plain."""

import gguf
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernel_support import ext  # noqa: F401 (a fixture)
from kernel_support import (TILE_WALK_DRAWS, check_schedules_with_drafter, check_tile_bits_everywhere, load_tiled_gguf,
                            requires_kernels)
from gmlx.config import env_overrides
from gmlx.models.loader import load_model
from gmlx.platform import cpu_kernels

pytestmark = requires_kernels

FIVE, IQ4 = cpu_kernels.FIVE_BITS, cpu_kernels.IQ4_BITS
BLOCK_BYTES = {FIVE: 384, IQ4: 320}  # a tile block's: weights, then 16 float16 scales and 16 biases


def narrow_rows(layout: int, num_outputs: int, num_inputs: int, seed: int) -> tuple[mx.array, mx.array, mx.array]:
    """MLX 8-bit triplets (group 32) whose levels are random in [0, 31] (FIVE) or among IQ4's codebook
    levels (IQ4), float16 scales and biases."""
    rng = np.random.default_rng(seed)
    choices = np.arange(32) if layout == FIVE else np.array(cpu_kernels.IQ4_LEVELS)
    levels = rng.choice(choices, (num_outputs, num_inputs)).astype(np.uint8)
    groups = (num_outputs, num_inputs // 32)
    scales = rng.uniform(1e-3, 2e-2, groups).astype(np.float16)
    biases = rng.uniform(-0.3, 0.0, groups).astype(np.float16)
    return mx.array(levels.view("<u4")), mx.array(scales), mx.array(biases)


def test_the_iq4_levels_are_the_gguf_decoders():
    """The kernels' IQ4 levels (cpu_kernels.IQ4_LEVELS, int8_dot_kernels.h's kIq4Levels) are the
    codebook values plus 128 that gguf_blocks reads IQ4_NL and IQ4_XS blocks into."""
    from gmlx.models import gguf_blocks

    assert cpu_kernels.IQ4_LEVELS == tuple(int(v) + 128 for v in gguf_blocks._IQ4_VALUES)



@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    num_blocks=st.integers(1, 12),
    num_rows=st.one_of(st.integers(1, 6), st.integers(7, 20)),
    layout=st.sampled_from([FIVE, IQ4]),
    **TILE_WALK_DRAWS,
)
def test_narrow_tiles_give_the_8_bit_tiles_bits(num_blocks, num_outputs, num_rows, prefetch_blocks, amx, seed,
                                                layout, ext):
    """The same integer block sums and float steps as the 8-bit tiles over the same rows: the same
    bits at every row, thread count, pool split, ISA, GFNI setting and prefetch distance (AMX on or
    off: narrow tiles walk on VNNI); and 0.75 (5-bit) or 0.625 (IQ4) bytes a weight with the scales,
    against 1.125."""
    num_inputs = 32 * num_blocks
    w, scales, biases = narrow_rows(layout, num_outputs, num_inputs, seed)
    ext.set_tile_layout(True)
    ext.set_amx(int(amx))
    eight = cpu_kernels.pack_quads(w, scales, biases, 32, 8)
    narrow = cpu_kernels.pack_quads(w, scales, biases, 32, 8, layout)
    tiles = -(-num_outputs // 16)
    assert narrow.size == ext.quad_layout_bytes(num_outputs, num_inputs, layout)
    assert narrow.size == tiles * num_blocks * BLOCK_BYTES[layout]
    assert eight.size == tiles * num_blocks * 576
    x = 3.0 * mx.random.normal((num_rows, num_inputs), key=mx.random.key(seed + 1))
    ext.set_num_threads(1)
    ext.set_isa("portable")
    expected = cpu_kernels.quantized_matmul_quads(x, eight, num_outputs, 8)
    mx.eval(expected)
    ext.set_prefetch_chunks(prefetch_blocks)
    check_tile_bits_everywhere(ext, x, narrow, num_outputs, layout, expected)


@pytest.mark.parametrize("layout", [FIVE, IQ4])
def test_narrow_lookups_are_the_8_bit_tiles(layout, ext):
    """A row looked up (a tied head's embedding) is the 8-bit layout's row, value for value."""
    w, scales, biases = narrow_rows(layout, 37, 256, seed=4)
    ext.set_tile_layout(True)
    ids = mx.array([[0, 36, 5], [17, 17, 99]])
    narrow = cpu_kernels.lookup_quads(cpu_kernels.pack_quads(w, scales, biases, 32, 8, layout), ids, 37, 256, layout)
    eight = cpu_kernels.lookup_quads(cpu_kernels.pack_quads(w, scales, biases, 32, 8), ids, 37, 256, 8)
    assert mx.array_equal(narrow, eight).item()


@pytest.mark.parametrize("layout", [FIVE, IQ4])
def test_narrow_tiles_are_refused_outside_the_tile_layout_and_from_other_rows(layout, ext):
    w, scales, biases = narrow_rows(layout, 16, 64, seed=1)
    ext.set_tile_layout(False)
    with pytest.raises(ValueError, match=f"layout_bits {layout}: expected the rows' bits, or 5 or {IQ4} from 8-bit"):
        cpu_kernels.pack_quads(w, scales, biases, 32, 8, layout)
    assert not cpu_kernels.narrow_tiles_available()
    ext.set_tile_layout(True)
    narrow = cpu_kernels.pack_quads(w, scales, biases, 32, 8, layout)
    w4, scales4, biases4 = mx.quantize(mx.ones((16, 64)), group_size=32, bits=4)
    with pytest.raises(ValueError, match=f"layout_bits {layout}"):
        cpu_kernels.pack_quads(w4, scales4.astype(mx.float16), biases4.astype(mx.float16), 32, 4, layout)
    with pytest.raises(ValueError, match="layout_bits 6"):
        cpu_kernels.pack_quads(w, scales, biases, 32, 8, 6)
    ext.set_tile_layout(False)
    with pytest.raises(ValueError, match=f"bits {layout}: expected 4, 8 or"):
        cpu_kernels.quantized_matmul_quads(mx.ones((1, 64)), narrow, 16, layout)


@pytest.mark.parametrize("levels_fit", [True, False])
def test_a_narrow_layout_is_probed_against_its_triplets_at_load(levels_fit, ext, caplog):
    """A module read from Q5_0 blocks is packed as 5-bit tiles only where their product matches its
    triplets' (levels that do not fit 5 bits, as a mislabelled type would give, are refused by the
    probe with a warning, and the module keeps its 8 bits)."""
    import mlx.nn as nn

    from gmlx.platform.cpu_quantized import float16_groups, use_cpu_kernels

    if not cpu_kernels.extension().has_avx512_vnni():
        pytest.skip("the narrow tiles are packed on CPUs with AVX-512 VNNI only")
    w, scales, biases = narrow_rows(FIVE if levels_fit else IQ4, 48, 512, seed=5)  # IQ4's levels reach 241
    model = nn.Sequential(nn.QuantizedLinear(512, 48, bias=False, group_size=32, bits=8))
    module = model.layers[0]
    module.weight, module.scales, module.biases = w, scales, biases
    module.gguf_kind = "Q5_0"
    halves = float16_groups(model)
    model.set_dtype(mx.float32)
    ext.set_tile_layout(True)
    with env_overrides({"GMLX_CPU_QUANT_ACTIVATIONS": "int8"}):
        assert use_cpu_kernels(model, None, halves) == 1
    assert module.layout_bits == (FIVE if levels_fit else 8)
    assert ("5-bit tiles off" in caplog.text) != levels_fit


# A Q5_0 file with Q5_1 and Q8_0 matrices among its own, as llama.cpp writes small models' Q5_K_M
# files (their 576-wide rows take Q5_1 and Q8_0 where Q5_K needs multiples of 256), and IQ4 ones.
Q = gguf.GGMLQuantizationType
OTHER_TYPES = {"blk.0.attn_q.weight": Q.Q5_1, "blk.1.ffn_up.weight": Q.Q5_1, "blk.0.attn_v.weight": Q.Q8_0,
               "blk.1.attn_k.weight": Q.IQ4_NL, "blk.0.ffn_down.weight": Q.IQ4_XS}
LAYOUTS = {"model.layers.0.self_attn.v_proj": 8, "model.layers.1.self_attn.k_proj": IQ4,
           "model.layers.0.mlp.down_proj": IQ4}


@pytest.fixture(scope="module")
def narrow_target(tmp_path_factory):
    """A tiny llama of Q5_0, Q5_1, IQ4_NL, IQ4_XS and Q8_0 matrices, as a GGUF, loaded with the tile layout on."""
    yield from load_tiled_gguf(tmp_path_factory.mktemp("narrow"), 12, Q.Q5_0, OTHER_TYPES)


def test_a_file_keeps_its_narrow_levels_in_narrow_tiles_with_the_8_bit_packings_logits(narrow_target, ext):
    """On a VNNI CPU every Q5_0/Q5_1 product is a 5-bit tile, every IQ4 one an IQ4 tile and the Q8_0
    one stays 8-bit; the logits are those of the same file packed at 8 bits (GMLX_CPU_FIVE_BIT_TILES=0,
    GMLX_CPU_IQ4_TILES=0), bit for bit."""
    ext.set_tile_layout(True)
    products = {name: m.layout_bits for name, m in narrow_target.model.named_modules() if hasattr(m, "layout_bits")}
    is_vnni = ext.has_avx512_vnni()
    expected_bits = {name: LAYOUTS.get(name, FIVE) if is_vnni else 8 for name in products if name != "lm_head"}
    assert expected_bits and {name: products[name] for name in expected_bits} == expected_bits
    with env_overrides({"GMLX_CPU_FIVE_BIT_TILES": "0", "GMLX_CPU_IQ4_TILES": "0"}):
        eight = load_model(narrow_target.path)
    assert {m.layout_bits for _, m in eight.model.named_modules() if hasattr(m, "layout_bits")} <= {4, 8}
    tokens = mx.array([[5, 17, 300, 41, 9, 1000, 77, 3]])
    _, expected = eight.forward(tokens, None)
    _, got = narrow_target.forward(tokens, None)
    assert mx.array_equal(got, expected).item()


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_speculative_and_batched_equal_plain_in_narrow_tiles(kind, narrow_target, code_prompts, ext):
    ext.set_tile_layout(True)  # the setting the target was packed under
    assert check_schedules_with_drafter(narrow_target, kind, code_prompts, range(710, 714)) > 0
