"""A model's float32 products in gmlx's CPU kernels, over weights kept as panels.

Through the BLAS a float32 decode step runs its products on one thread (OpenBLAS's own
threads stall when the front-end takes a core, gmlx/config.py's blas_threads), each a
separate graph node. At load on the CPU backend, modules of exactly `nn.Linear` (with or
without a bias) and a tied head's `nn.Embedding` keep their weights only in the kernels'
panel layout (native/mlx_cpu_kernels/float_matmul.h: (N/64, K, 64), the same
bytes) and multiply in gmlx.platform.cpu_kernels at every row count, on the kernels'
pool. Each output is one fma chain over the inputs, so a row's bits never depend on how
many rows or threads share the call; they differ from the BLAS's in the last bits, which
a probe at load bounds before any module is swapped. The decode ops and fused llama
layers then take these models too. GMLX_CPU_FLOAT_KERNELS=0 keeps the BLAS path (the
interposer, input-major weights), which is bit-identical to mlx-lm's.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn

from gmlx.platform import cpu_kernels

logger = logging.getLogger(__name__)

# Largest |kernel - x @ W.T| accepted at the probe, relative to the largest |x @ W.T|: the
# two sum in other orders (measured ~1e-6 on random normal rows).
_PROBE_RTOL = 1e-4


def pack_panels(weight: mx.array) -> mx.array:
    """W (N, K) as the kernels' panels (ceil(N / 64), K, 64), zero past N."""
    num_outputs, num_inputs = weight.shape
    width = cpu_kernels.PANEL_OUTPUTS
    pad = -num_outputs % width
    if pad:
        weight = mx.concatenate([weight, mx.zeros((pad, num_inputs), weight.dtype)])
    return mx.contiguous(weight.reshape(-1, width, num_inputs).transpose(0, 2, 1))


class KernelLinear(nn.Linear):
    """nn.Linear over panels; `bits` and `num_outputs` as the fused layers read a product's."""

    bits = cpu_kernels.FLOAT_BITS

    def __call__(self, x: mx.array) -> mx.array:
        y = cpu_kernels.float_matmul(x, self["panels"], self.num_outputs)
        return y + self["bias"] if "bias" in self else y

    def _extra_repr(self) -> str:
        return f"input_dims={self.num_inputs}, output_dims={self.num_outputs}, bias={'bias' in self}, panels"


class KernelEmbedding(nn.Embedding):
    """A tied head's token table, kept once as panels: lookups gather a token's column."""

    def __call__(self, x: mx.array) -> mx.array:
        width = cpu_kernels.PANEL_OUTPUTS
        return self["panels"][x // width, :, x % width]  # (..., K)

    def as_linear(self, x: mx.array) -> mx.array:
        return cpu_kernels.float_matmul(x, self["panels"], self.num_outputs)

    def _extra_repr(self) -> str:
        return f"{self.num_outputs}, {self.num_inputs}, panels"


_SWAPS = {nn.Linear: KernelLinear, nn.Embedding: KernelEmbedding}


def _is_swappable(module: nn.Module, head: nn.Module | None) -> bool:
    if type(module) not in _SWAPS or (type(module) is nn.Embedding and module is not head):
        return False  # an untied token table has no product to speed up
    weight = module["weight"]
    return weight.dtype == mx.float32 and weight.ndim == 2 and weight.shape[0] > 0 and weight.shape[1] > 0


def _is_close(weight: mx.array) -> bool:
    """The kernel over the packed weight against x @ W.T on a probe of 3 rows."""
    x = mx.random.normal((1, 3, weight.shape[1]), key=mx.random.key(weight.shape[1]))
    got = cpu_kernels.float_matmul(x, pack_panels(weight), weight.shape[0])
    return cpu_kernels.is_close_to(got, x @ weight.T, _PROBE_RTOL)


def use_float_kernels(model: nn.Module, head: nn.Module | None = None) -> int:
    """Keep the model's float32 linear weights (and a tied head's table) as panels, products in
    the kernels; how many modules. 0 (the model untouched) where the kernels lack the product
    or a probe of any weight shape is not within tolerance."""
    if not cpu_kernels.is_built() or not hasattr(cpu_kernels.extension(), "float_matmul"):
        return 0
    if cpu_kernels.extension().best_isa() == "portable":
        return 0  # no AVX2 + FMA (another architecture): a scalar loop would lose to its BLAS
    modules = [m for _, m in model.named_modules() if _is_swappable(m, head)]
    for shape, module in {tuple(m["weight"].shape): m for m in modules}.items():
        if not _is_close(module["weight"]):
            logger.warning("not using the float32 CPU kernels: a %s product disagrees with the BLAS's", shape)
            return 0
    packed: dict[int, mx.array] = {}  # a weight shared by several modules is packed once
    for module in modules:
        weight = module["weight"]
        if id(weight) not in packed:
            packed[id(weight)] = pack_panels(weight)
            mx.eval(packed[id(weight)])  # one at a time: each old copy goes as the next is made
        module.num_outputs, module.num_inputs = weight.shape
        module.panels = packed[id(weight)]
        del module["weight"]
        module.__class__ = _SWAPS[type(module)]
    return len(modules)
