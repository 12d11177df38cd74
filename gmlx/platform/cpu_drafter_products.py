"""A drafter's own products on the CPU, in the format its target runs in.

An MTP head loads as float32 (its file is float16), and at one row its float32 products read
more bytes than a 4-bit target's whole layer: on SmolLM2 Q4_1 a draft took 40% of a target
step, half of it the head (products, and norms of several mlx nodes each), half the output
product. Drafts are proposals the verify accepts or replaces, so a drafter may round as its
target does: a quantized target's drafter products are quantized to the target's bits and run
in the same kernels, with its norms and SwiGLU as the kernels' one-node ops; a float32
target's drafter keeps float32, stored input-major for the interposer as before.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from gmlx import config
from gmlx.platform import cpu_kernels
from gmlx.platform.cpu_layout import store_weights_input_major
from gmlx.platform.cpu_decode_ops import PROBE_ATOL, use_cpu_decode_ops
from gmlx.platform.cpu_quantized import use_cpu_kernels


def quantized_format(module: nn.Module) -> tuple[int, int] | None:
    """(bits, group_size) of the first affine-quantized product under `module`, else None."""
    for _, child in module.named_modules():
        if isinstance(child, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            return child.bits, child.group_size
    return None


def _float_linears(module: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(name, m) for name, m in module.named_modules() if type(m) is nn.Linear and m.weight.ndim == 2]


def _use_quantized_kernels(module: nn.Module, bits: int, group_size: int, is_head: bool) -> int:
    """Quantize the float linear modules under `module` and run them in the CPU kernels; how many.
    0, and the module as it was, where the kernels cannot take that format or their probe disagrees."""
    if not cpu_kernels.is_built() or not cpu_kernels.can_run(bits, group_size):
        return 0
    originals = _float_linears(module)
    if not originals or any(m.weight.shape[1] % group_size for _, m in originals):
        return 0
    nn.quantize(module, group_size=group_size, bits=bits, class_predicate=lambda _, m: type(m) is nn.Linear)
    quantized = [m for _, m in module.named_modules() if isinstance(m, nn.QuantizedLinear)]
    # is_head: a lone output product, which the kernels may run with int8 inputs at 8 bits too.
    num_swapped = use_cpu_kernels(module, quantized[0] if is_head and len(quantized) == 1 else None)
    if num_swapped == 0:
        module.update_modules(tree_unflatten(originals))
    return num_swapped


def _use_kernel_ops(module: nn.Module) -> None:
    """Its norms, and a SwiGLU it keeps as its `swiglu` attribute, one kernel node each as the
    target's are: each mlx norm is several nodes, and a SmolLM2 draft ran 0.68 -> 0.36 ms."""
    if not config.is_cpu_decode_ops_enabled() or not use_cpu_decode_ops(module) or not hasattr(module, "swiglu"):
        return
    gate, up = mx.random.normal((2, 2, 64), key=mx.random.key(5))
    if cpu_kernels.is_close_to(cpu_kernels.swiglu(gate, up), module.swiglu(gate, up), PROBE_ATOL):
        module.swiglu = cpu_kernels.swiglu


def prepare_drafter_products(module: nn.Module, target_format: tuple[int, int] | None,
                             is_head: bool = False) -> str:
    """Lay out a drafter module's float32 linear weights for the CPU: quantized to target_format
    (bits, group_size) in the kernels when its target is quantized, else input-major float32.
    Returns what it did, for the log."""
    if mx.default_device() != mx.cpu:
        return "as loaded (not the CPU)"
    if target_format is not None and config.is_cpu_kernels_enabled() and config.is_drafter_quantized():
        bits, group_size = target_format
        if _use_quantized_kernels(module, bits, group_size, is_head):
            _use_kernel_ops(module)
            return f"{bits}-bit in the CPU kernels"
    if config.is_input_major_enabled() and store_weights_input_major(module):
        return "float32, input-major"
    return "float32"
