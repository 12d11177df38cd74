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
any module is swapped. With GMLX_CPU_QUANT_ACTIVATIONS=int8 the 4-bit products quantize
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


def _kernel_product(module: nn.Module, x: mx.array, int8_activations: bool | None = None) -> mx.array:
    if int8_activations is None:
        int8_activations = module.is_int8_activations
    return cpu_kernels.quantized_matmul(
        x, module["weight"], module["scales"], module["biases"], module.group_size, module.bits, int8_activations)


class KernelQuantizedLinear(nn.QuantizedLinear):
    is_int8_activations = False  # set per module at the swap (GMLX_CPU_QUANT_ACTIVATIONS)

    def __call__(self, x: mx.array) -> mx.array:
        y = _kernel_product(self, x)  # (..., out)
        return y + self["bias"] if "bias" in self else y


class KernelQuantizedEmbedding(nn.QuantizedEmbedding):
    is_int8_activations = False

    def __call__(self, x: mx.array) -> mx.array:
        scales, biases = self["scales"][x], self["biases"][x]
        if scales.dtype == mx.float16:  # stored in half (_store_half_groups): the same values, looked up in float32
            scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
        return mx.dequantize(self["weight"][x], scales, biases, group_size=self.group_size, bits=self.bits, mode=self.mode)

    def as_linear(self, x: mx.array) -> mx.array:
        return _kernel_product(self, x)  # (..., num_embeddings)


_SWAPS = {nn.QuantizedLinear: KernelQuantizedLinear, nn.QuantizedEmbedding: KernelQuantizedEmbedding}


def _is_swappable(module: nn.Module) -> bool:
    if type(module) not in _SWAPS or not cpu_kernels.can_run(module.bits, module.group_size, module.mode):
        return False
    biases = module.get("biases")
    return (biases is not None and module["weight"].dtype == mx.uint32
            and module["scales"].dtype == mx.float32 and biases.dtype == mx.float32)


def _is_close(module: nn.Module, int8_activations: bool) -> bool:
    """Does the kernel match dequantize + float32 matmul on a probe for this module?"""
    weight = mx.dequantize(module["weight"], module["scales"], module["biases"],
                           group_size=module.group_size, bits=module.bits)  # (out, K)
    x = mx.random.normal((1, 3, weight.shape[1]), key=mx.random.key(weight.shape[1]))  # (B, T, K)
    tolerance = cpu_kernels.INT8_ACTIVATIONS_RTOL if int8_activations else _PROBE_RTOL
    return cpu_kernels.is_close_to(_kernel_product(module, x, int8_activations), x @ weight.T, tolerance)


def _can_quantize_activations(modules: list[nn.Module], probes: dict) -> bool:
    """GMLX_CPU_QUANT_ACTIVATIONS=int8 and every probe within the int8 path's tolerance."""
    if config.cpu_quant_activations() != "int8" or not hasattr(cpu_kernels.extension(), "has_avx512_vnni"):
        return False
    for key, module in probes.items():
        if module.bits in cpu_kernels.INT8_ACTIVATIONS_BITS and not _is_close(module, True):
            logger.warning("int8 activations off (float path kept): a %s product is not within %.0e of mlx's",
                           key[1], cpu_kernels.INT8_ACTIVATIONS_RTOL)
            return False
    return any(m.bits in cpu_kernels.INT8_ACTIVATIONS_BITS for m in modules)


def _store_half_groups(module: nn.Module) -> bool:
    """Keep an int8-activation module's scales and biases in float16 where float16 holds every
    one exactly (a GGUF's Q4_1 d and m): its kernel then reads 0.625 bytes a weight, not 0.75."""
    halves = [module[name].astype(mx.float16) for name in ("scales", "biases")]
    if not all(mx.array_equal(h.astype(mx.float32), module[name]).item() for h, name in zip(halves, ("scales", "biases"))):
        return False
    module.scales, module.biases = halves
    return True


def use_cpu_kernels(model: nn.Module) -> int:
    """Swap the model's affine 4/8-bit quantized modules for kernel-backed ones; how many.

    0 (the model untouched) when the kernels are unavailable or a probe disagrees.
    """
    if not cpu_kernels.is_built():
        return 0
    modules = [m for _, m in model.named_modules() if _is_swappable(m)]
    probes = {(type(m), m["weight"].shape, m.bits, m.group_size): m for m in modules}
    for key, module in probes.items():
        if not _is_close(module, False):
            logger.warning("not using the CPU kernels: a %s product disagrees with mlx's dequantize", key[1])
            return 0
    is_int8 = _can_quantize_activations(modules, probes)
    num_half = 0
    for module in modules:
        module.__class__ = _SWAPS[type(module)]
        module.is_int8_activations = is_int8 and module.bits in cpu_kernels.INT8_ACTIVATIONS_BITS
        num_half += module.is_int8_activations and _store_half_groups(module)
    if is_int8:
        logger.info("CPU kernels: 4-bit products quantize their activations to int8 (GMLX_CPU_QUANT_ACTIVATIONS); "
                    "%d of %d modules keep exact float16 scales", num_half, len(modules))
    return len(modules)
