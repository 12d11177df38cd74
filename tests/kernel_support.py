"""What the CPU-kernel test files share: the extension with its settings restored, the ISAs
this CPU runs, the settings a tile walk's bits must not depend on (as hypothesis strategies), a
model saved in 4 bits and loaded on the kernels' path, a tiny GGUF of given tensor types loaded
under the tile layout, and the identity check over random schedules with the kernels on."""

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from hypothesis import strategies as st
from mlx.utils import tree_flatten

from gmlx.config import EngineConfig, env_overrides
from gmlx.drafters import make_drafter
from gmlx.engine import Engine
from gmlx.models import random_model
from gmlx.models.loader import load_model
from gmlx.platform import cpu_kernels
from schedules import SoloReference, check_schedule, make_schedule

requires_kernels = pytest.mark.skipif(
    not cpu_kernels.is_built(), reason=f"gmlx CPU kernels not built: {cpu_kernels.status()['reason']}")


# What a tile layout's property tests draw beside their own shapes: outputs that leave partial tiles and
# split thread chunks, the prefetch distance, AMX on or off, and the data's seed (given(**TILE_WALK_DRAWS)).
TILE_WALK_DRAWS = dict(num_outputs=st.integers(1, 40), prefetch_blocks=st.sampled_from([-1, 0, 8]),
                       amx=st.booleans(), seed=st.integers(0, 2**16))


@pytest.fixture
def ext():
    """The extension, with its thread count, ISA, panel and many-row switch points, pool threshold,
    prefetch distances, one-stream layout (tiles, half tails), AMX and GFNI settings restored after the test."""
    ext = cpu_kernels.extension()
    num_threads, isa, panel_min_rows = ext.num_threads(), ext.isa(), ext.panel_min_rows()
    min_pool_macs, prefetch_chunks, half_tails = ext.min_pool_macs(), ext.prefetch_chunks(), ext.half_tails()
    tile_layout, panel_prefetch_bytes, amx = ext.tile_layout(), ext.panel_prefetch_bytes(), ext.amx_setting()
    many_rows_min, gfni = ext.many_rows_min(), ext.gfni_setting()
    yield ext
    ext.set_gfni(gfni)
    ext.set_many_rows_min(many_rows_min)
    ext.set_amx(amx)
    ext.set_panel_prefetch_bytes(panel_prefetch_bytes)
    ext.set_tile_layout(tile_layout)
    ext.set_half_tails(half_tails)
    ext.set_num_threads(num_threads)
    ext.set_isa(isa)
    ext.set_panel_min_rows(panel_min_rows)
    ext.set_min_pool_macs(min_pool_macs)
    ext.set_prefetch_chunks(prefetch_chunks)


def supported_isas(ext) -> list[str]:
    order = ["portable", "avx2", "avx512"]
    return order[: order.index(ext.best_isa()) + 1]


def gfni_settings(ext) -> tuple[int, ...]:
    """The K5/K6/5-bit tiles' top bits by shifts (0) and, where the CPU has it, by GFNI (1): the same bits."""
    return (0, 1) if ext.has_gfni() else (0,)


def check_tile_bits_everywhere(ext, x: mx.array, tiles: mx.array, num_outputs: int, bits: int,
                               expected: mx.array) -> None:
    """The product of a one-stream layout over x, and over x's last row alone, is `expected` bit for
    bit at every thread count, pool split, ISA and GFNI setting."""
    for num_threads, min_pool_macs in ((1, -1), (2, 0), (2, -1)):
        ext.set_num_threads(num_threads)
        ext.set_min_pool_macs(min_pool_macs)
        for isa in supported_isas(ext):
            ext.set_isa(isa)
            for gfni in gfni_settings(ext):
                ext.set_gfni(gfni)
                got = cpu_kernels.quantized_matmul_quads(x, tiles, num_outputs, bits)
                assert got.shape == expected.shape and mx.array_equal(got, expected).item(), (num_threads, isa, gfni)
                alone = cpu_kernels.quantized_matmul_quads(x[-1:], tiles, num_outputs, bits)
                assert mx.array_equal(alone, expected[-1:]).item(), (num_threads, isa, gfni)


def check_schedules_with_drafter(target, kind: str, code_prompts, seeds) -> int:
    """Every stream of random schedules (one per seed) equals solo plain decoding, speculating
    with `kind` (ngram, or the target as its own draft model); returns the speculative rounds."""
    drafter = make_drafter(kind if kind == "ngram" else f"draft:{target.path}", target)
    engine = Engine(target, drafter, EngineConfig())
    reference = SoloReference(target)
    return sum(check_schedule(engine, reference, make_schedule(seed, target.vocab_size, code_prompts,
                                                                max_requests=6)).counters["num_spec_rounds"]
               for seed in seeds)


def load_quantized_copy(model: nn.Module, config: dict, tokenizer_dir: Path, folder: Path,
                        is_gguf_like: bool = False, eight_bit_modules: tuple = ()):
    """`model` quantized to 4 bits (group 32), saved in `folder` the way mlx-lm stores quantized
    folders, and loaded by gmlx in the 4-bit compute format (on CPU `auto` may choose float32).

    is_gguf_like: as a Q4_1 GGUF arrives: scales and biases float16 holds exactly, and the
    embedding (the tied head where the config ties it) at 8 bits, like its Q8_0 token table.
    eight_bit_modules: module paths kept at 8 bits, as a K-quant GGUF mixes them within a layer."""
    quantization = {"group_size": 32, "bits": 4}
    if is_gguf_like:
        quantization["model.embed_tokens"] = {"group_size": 32, "bits": 8}
    quantization.update({path: {"group_size": 32, "bits": 8} for path in eight_bit_modules})

    def per_module(path, module):
        return quantization.get(path, hasattr(module, "to_quantized"))

    nn.quantize(model, group_size=32, bits=4, class_predicate=per_module)
    if is_gguf_like:
        for _, m in model.named_modules():
            if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
                m.scales, m.biases = (a.astype(mx.float16).astype(mx.float32) for a in (m.scales, m.biases))
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps({**config, "quantization": quantization}))
    random_model.copy_tokenizer(tokenizer_dir, folder)
    with env_overrides({"GMLX_CPU_COMPUTE_FORMAT": "quantized"}):
        return load_model(folder)


def load_tiled_gguf(folder: Path, seed: int, quant_type, types: dict):
    """A fixture's body: a tiny llama (widths multiples of 256, as K-quants and IQ4_XS need) written
    under `folder` as a GGUF of quant_type with `types` per tensor, loaded and yielded with the tile
    layout on, the setting restored after."""
    from conftest import make_random_model_dir
    from gguf_support import write_gguf_from_folder

    model_dir = make_random_model_dir(folder / "folder", seed=seed, hidden_size=256, intermediate_size=512,
                                      head_dim=64)
    path = write_gguf_from_folder(model_dir, folder / "model.gguf", quant_type=quant_type, types=types)
    ext = cpu_kernels.extension()
    was_tiles = ext.tile_layout()
    ext.set_tile_layout(True)
    try:
        yield load_model(path)
    finally:
        ext.set_tile_layout(was_tiles)
