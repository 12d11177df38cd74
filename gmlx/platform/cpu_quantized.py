"""A model's affine-quantized products in gmlx's CPU kernels.

On the CPU backend, MLX's `quantized_matmul` dequantizes slowly: a 4096x4096 4-bit
product of one row took longer than the same product in float32 through the BLAS.
At load, modules of exactly `nn.QuantizedLinear` and `nn.QuantizedEmbedding` (its
`as_linear`, the tied output head) become subclasses whose products run in
gmlx.platform.cpu_kernels at every row count: a row's bits then never depend on how many
rows share the call (a batch of 20 decode rows must give each row what it gets alone,
and mlx's own product at some row counts would not), and mlx's CPU product is slower at
every row count measured. The kernels sum in another order than mlx, so a probe at load
checks each weight shape against dequantize + float32 matmul within a tolerance before
any module is swapped. With GMLX_CPU_QUANT_ACTIVATIONS=int8 the 4- and 8-bit products quantize
their input rows to int8 (integer dots, like llama.cpp's Q4 x Q8), behind a looser probe of
their own; where it fails, the whole model keeps the float path.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn

from gmlx import config
from gmlx.platform import cpu_kernels

logger = logging.getLogger(__name__)

# Largest |kernel - reference| accepted at the probe, relative to the largest |reference|.
_PROBE_RTOL = 1e-4
_PROBE_OUTPUTS = 512  # outputs a probe runs: enough for the pool to split them
K_QUANT_BLOCK_VALUES = 256  # a GGUF K-quant block's weights
K_QUANT_BLOCK_BYTES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
# The bits of the triplets a K-quant matrix loads as (gguf_blocks: Q4_K's levels, Q5_K's at 8 bits,
# Q2_K, Q3_K and Q6_K requantized).
_K_QUANT_TRIPLET_BITS = {"Q2_K": 8, "Q3_K": 8, "Q4_K": 4, "Q5_K": 8, "Q6_K": 8}


def _kernel_product(module: nn.Module, x: mx.array) -> mx.array:
    if "quads" in module:  # the weights live only in the int8 path's layout (_store_quads)
        assert module.is_int8_activations, "a module in the quad layout runs the int8 path only"
        return cpu_kernels.quantized_matmul_quads(x, module["quads"], module.num_outputs, module.layout_bits)
    return cpu_kernels.quantized_matmul(x, module["weight"], module["scales"], module["biases"], module.group_size,
                                        module.bits, module.is_int8_activations)


class KernelQuantizedLinear(nn.QuantizedLinear):
    is_int8_activations = False  # set per module at the swap (GMLX_CPU_QUANT_ACTIVATIONS)

    def __call__(self, x: mx.array) -> mx.array:
        y = _kernel_product(self, x)  # (..., out)
        return y + self["bias"] if "bias" in self else y


class KernelQuantizedEmbedding(nn.QuantizedEmbedding):
    is_int8_activations = False

    def __call__(self, x: mx.array) -> mx.array:
        if "quads" in self:  # the tied head's weights, kept once, in the int8 path's layout
            return cpu_kernels.lookup_quads(self["quads"], x, self.num_outputs, self.num_inputs, self.layout_bits)
        scales, biases = self["scales"][x], self["biases"][x]
        if scales.dtype == mx.float16:  # stored in half (_store_half_groups): the same values, looked up in float32
            scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
        return mx.dequantize(self["weight"][x], scales, biases, group_size=self.group_size, bits=self.bits,
                             mode=self.mode)

    def as_linear(self, x: mx.array) -> mx.array:
        return _kernel_product(self, x)  # (..., num_embeddings)


_SWAPS = {nn.QuantizedLinear: KernelQuantizedLinear, nn.QuantizedEmbedding: KernelQuantizedEmbedding}


def project(x: mx.array, modules: tuple) -> list[mx.array]:
    """Each module's product of x (q/k/v, gate/up). Modules all in the quad layout at one bit
    width run as one kernel node (x quantized once, one pool job), with their own calls' bits."""
    is_grouped = (len(modules) > 1 and all(type(m) is KernelQuantizedLinear and "quads" in m for m in modules)
                  and len({(m.layout_bits, m.num_inputs) for m in modules}) == 1)
    if not is_grouped:
        return [m(x) for m in modules]
    outputs = cpu_kernels.quantized_matmul_quads_group(
        x, [m["quads"] for m in modules], [m.num_outputs for m in modules], modules[0].layout_bits)
    return [y + m["bias"] if "bias" in m else y for y, m in zip(outputs, modules)]


def _is_swappable(module: nn.Module) -> bool:
    if type(module) not in _SWAPS or not cpu_kernels.can_run(module.bits, module.group_size, module.mode):
        return False
    biases = module.get("biases")
    return (biases is not None and module["weight"].dtype == mx.uint32
            and module["scales"].dtype == mx.float32 and biases.dtype == mx.float32)


def _probe_reference(module: nn.Module) -> tuple[mx.array, mx.array]:
    """A probe's input x (1, 3, K) and x @ the module's first _PROBE_OUTPUTS dequantized rows in
    float32 (its scales float16 or float32: the same values): the kernels' paths for its shape,
    without a large head's floats (an 8B model's: 2 GB)."""
    w, scales, biases = (module[name][:_PROBE_OUTPUTS] for name in ("weight", "scales", "biases"))
    weight = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=module.group_size,
                           bits=module.bits)  # (out, K)
    x = mx.random.normal((1, 3, weight.shape[1]), key=mx.random.key(weight.shape[1]))  # (B, T, K)
    return x, x @ weight.T


def _is_close(module: nn.Module, int8_activations: bool) -> bool:
    """Does the kernel match dequantize + float32 matmul on a probe for this module?"""
    x, expected = _probe_reference(module)
    w, scales, biases = (module[name][:_PROBE_OUTPUTS] for name in ("weight", "scales", "biases"))
    tolerance = cpu_kernels.INT8_ACTIVATIONS_RTOL if int8_activations else _PROBE_RTOL
    got = cpu_kernels.quantized_matmul(x, w, scales, biases, module.group_size, module.bits, int8_activations)
    return cpu_kernels.is_close_to(got, expected, tolerance)


def _takes_int8(module: nn.Module, head: nn.Module | None) -> bool:
    """Would the int8 mode quantize this module's activations (its bits, and whether it is the head)?"""
    bits = cpu_kernels.INT8_ACTIVATIONS_HEAD_BITS if module is head else cpu_kernels.INT8_ACTIVATIONS_BITS
    return module.bits in bits


def _can_quantize_activations(modules: list[nn.Module]) -> bool:
    """GMLX_CPU_QUANT_ACTIVATIONS=int8, some modules to take it, and every probe of theirs within
    the int8 path's tolerance."""
    if config.cpu_quant_activations() != "int8" or not hasattr(cpu_kernels.extension(), "has_avx512_vnni"):
        return False
    for key, module in _probes(modules).items():
        if not _is_close(module, True):
            logger.warning("int8 activations off (float path kept): a %s product is not within %.0e of mlx's",
                           key[1], cpu_kernels.INT8_ACTIVATIONS_RTOL)
            return False
    return bool(modules)


def _probes(modules: list[nn.Module]) -> dict:
    """One module per kind, weight shape, bits and group size: what a load-time probe checks."""
    return {(type(m), m["weight"].shape, m.bits, m.group_size): m for m in modules}


def float16_groups(model: nn.Module) -> dict:
    """Each quantized module's scales and biases where both are float16 (a GGUF's), by id(module):
    taken before the model is cast to float32, they are what _store_half_groups keeps, without
    casting the float32 copies back to compare (2.7 s of an 8B file's load)."""
    # Each entry holds its module too, so no other module can take its id while the dict lives.
    return {id(m): (m, m["scales"], m["biases"]) for m in model.modules()
            if type(m) in _SWAPS and m.get("biases") is not None
            and m["scales"].dtype == mx.float16 and m["biases"].dtype == mx.float16}


def _store_half_groups(module: nn.Module, halves: dict) -> bool:
    """Keep an int8-activation module's scales and biases in float16 where float16 holds every
    one exactly (a GGUF's Q4_1 d and m): its kernel then reads 0.625 bytes a weight, not 0.75.
    halves: float16_groups of the model before its cast to float32; the module's entry is taken
    out (so a packed module's float16 groups are freed with it)."""
    if id(module) in halves:  # the float32 ones are casts of these: exact
        _, module.scales, module.biases = halves.pop(id(module))
        return True
    names = ("scales", "biases")
    casts = [module[name].astype(mx.float16) for name in names]
    if not all(mx.array_equal(h.astype(mx.float32), module[name]).item() for h, name in zip(casts, names)):
        return False
    module.scales, module.biases = casts
    return True


def output_dims(module: nn.Module) -> int:
    """A linear module's outputs, whatever layout its weights are kept in (rows, quads, panels)."""
    return module.num_outputs if "quads" in module or "panels" in module else module["weight"].shape[0]


def input_dims(module: nn.Module) -> int:
    """A quantized linear module's inputs, whatever layout its weights are kept in."""
    return module.num_inputs if "quads" in module else module["weight"].shape[1] * 32 // module.bits


def _k_tile_bits(module: nn.Module, k_blocks: tuple | None, probes: dict) -> int | None:
    """The K-tile layout this module's weights can be kept in from its GGUF blocks (k_blocks: (kind,
    rows x bytes), None where it has none), as the kernels name it; else None. probes: each kind and
    shape's probe result so far (one probe a kind and shape, as for the triplets' kernels)."""
    if k_blocks is None or not config.is_k_tile_layout_enabled():
        return None
    kind, blocks = k_blocks
    bits, num_inputs = cpu_kernels.k_tile_bits(kind), input_dims(module)
    if bits is None or module.bits != _K_QUANT_TRIPLET_BITS[kind] or num_inputs % K_QUANT_BLOCK_VALUES:
        return None
    if blocks.shape != (output_dims(module), num_inputs // K_QUANT_BLOCK_VALUES * K_QUANT_BLOCK_BYTES[kind]):
        return None
    return _probed_bits(module, probes, (kind, blocks.shape), bits, ("K-tiles", f"{kind} {blocks.shape}"),
                        lambda: cpu_kernels.pack_k_quant_tiles(blocks[:_PROBE_OUTPUTS], kind))


def _probed_bits(module: nn.Module, probes: dict, key: tuple, bits: int, named: tuple, pack) -> int | None:
    """`bits` where the product of pack() (the module's first rows, up to _PROBE_OUTPUTS, in the layout
    the kernels name by `bits`) matches x @ the module's dequantized triplets within the int8 path's
    tolerance, else None with a warning (named: the layout and the matrices it was tried on). One probe
    a key (a kind or layout and a shape): probes keeps each result. K-tiles hold the file's values
    within float16's rounding of a scale, or half an 8-bit level, of the triplets'; the narrow tiles
    their very levels."""
    if key not in probes:
        packed = pack()
        x, expected = _probe_reference(module)
        got = cpu_kernels.quantized_matmul_quads(x, packed, min(output_dims(module), _PROBE_OUTPUTS), bits)
        probes[key] = cpu_kernels.is_close_to(got, expected, cpu_kernels.INT8_ACTIVATIONS_RTOL)
        if not probes[key]:
            logger.warning("%s off for %s matrices: their product is not within %.0e of the triplets'", *named,
                           cpu_kernels.INT8_ACTIVATIONS_RTOL)
    return bits if probes[key] else None


def _narrow_bits(module: nn.Module) -> int | None:
    """The narrower tile layout this 8-bit module's levels fit by the GGUF type they were read from
    (module.gguf_kind, set at load): FIVE_BITS for Q5_0, Q5_1 and Q5_K (levels below 32), IQ4_BITS
    for IQ4_NL and IQ4_XS (IQ4's codebook levels), each where its setting is on; else None. By type,
    not by a scan of the levels: that took ~0.5 s a 58M-level matrix (an 8B Q8_0 file: a minute)."""
    kind = getattr(module, "gguf_kind", None)
    if kind in ("Q5_0", "Q5_1", "Q5_K") and config.is_five_bit_tiles_enabled():
        return cpu_kernels.FIVE_BITS
    if kind in ("IQ4_NL", "IQ4_XS") and config.is_iq4_tiles_enabled():
        return cpu_kernels.IQ4_BITS
    return None


def _narrow_layout(module: nn.Module, probes: dict) -> int | None:
    """The 5-bit or IQ4 tiles where this 8-bit module's levels fit them (_narrow_bits) and the
    kernels can hold them, after a probe a layout and shape, as for the other layouts; else None.
    probes: each layout and shape's probe result so far."""
    if module.bits != 8 or not cpu_kernels.narrow_tiles_available():
        return None
    layout_bits = _narrow_bits(module)
    if layout_bits is None:
        return None
    shape = module["weight"].shape
    named = ("5-bit tiles" if layout_bits == cpu_kernels.FIVE_BITS else "IQ4 tiles", shape)
    parts = ("weight", "scales", "biases")
    return _probed_bits(module, probes, (layout_bits, shape), layout_bits, named,
                        lambda: cpu_kernels.pack_quads(*(module[name][:_PROBE_OUTPUTS] for name in parts),
                                                       module.group_size, 8, layout_bits))


def _store_quads(module: nn.Module, k_blocks: tuple | None = None, k_probes: dict | None = None) -> None:
    """Keep an int8-activation module's weights in the kernels' quad layout only: one stream per
    product instead of twelve (4 rows of weights, scales, biases), 1.1-2x faster from DRAM (3x
    SmolLM2's 8-bit head), same bits. A tied head's lookups read the same layout. k_blocks: the
    module's GGUF K-quant blocks (Q2_K to Q6_K), (kind, rows x bytes), packed as K-tiles where _k_tile_bits
    says so: the file's own values in fewer bytes than the triplets' layout (k_probes: its probes)."""
    probes = {} if k_probes is None else k_probes
    k_bits = _k_tile_bits(module, k_blocks, probes)
    module.num_outputs, module.num_inputs = output_dims(module), input_dims(module)
    if k_bits is not None:
        module.quads, module.layout_bits = cpu_kernels.pack_k_quant_tiles(k_blocks[1], k_blocks[0]), k_bits
    else:
        layout_bits = _narrow_layout(module, probes) or module.bits
        module.quads = cpu_kernels.pack_quads(module["weight"], module["scales"], module["biases"],
                                              module.group_size, module.bits, layout_bits)
        module.layout_bits = layout_bits
    mx.eval(module.quads)
    for name in ("weight", "scales", "biases"):
        del module[name]


def runs_int8_activations(module: nn.Module) -> bool:
    """Does any product inside `module` quantize its activations to int8?"""
    return any(getattr(m, "is_int8_activations", False) for _, m in module.named_modules())


def use_cpu_kernels(model: nn.Module, head: nn.Module | None = None, halves: dict | None = None,
                    k_quant_blocks: dict | None = None) -> int:
    """Swap the model's affine 4/8-bit quantized modules for kernel-backed ones; how many.

    head: the module whose product gives the logits (an lm_head, or the tied embedding).
    halves: float16_groups(model) taken before the model was cast to float32 (its entries are
    taken out as the modules keep them).
    k_quant_blocks: GGUF K-quant blocks (Q2_K to Q6_K) by id(module), each (module, kind, blocks) (entries
    taken out as used).
    0 (the model untouched) when the kernels are unavailable or a probe disagrees.
    """
    if not cpu_kernels.is_built():
        return 0
    modules = [m for _, m in model.named_modules() if _is_swappable(m)]
    for key, module in _probes(modules).items():
        if not _is_close(module, False):
            logger.warning("not using the CPU kernels: a %s product disagrees with mlx's dequantize", key[1])
            return 0
    int8_modules = [m for m in modules if _takes_int8(m, head)]
    is_int8 = _can_quantize_activations(int8_modules)
    num_quads, k_probes = 0, {}
    for module in modules:
        module.__class__ = _SWAPS[type(module)]
        module.is_int8_activations = is_int8 and _takes_int8(module, head)
        entry = (k_quant_blocks or {}).pop(id(module), None)
        if module.is_int8_activations and _store_half_groups(module, halves or {}) and config.is_quad_layout_enabled():
            _store_quads(module, entry[1:] if entry else None, k_probes)
            num_quads += 1
    if is_int8:
        logger.info("CPU kernels: %d modules quantize their activations to int8 (GMLX_CPU_QUANT_ACTIVATIONS), "
                    "%d of %d in the one-stream layout (GMLX_CPU_QUAD_LAYOUT)", len(int8_modules), num_quads,
                    len(modules))
    return len(modules)
