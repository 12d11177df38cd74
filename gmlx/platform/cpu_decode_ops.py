"""A decode step's small ops as single graph nodes in gmlx's CPU kernels.

On the CPU backend mx.fast.rope has no kernel: even compiled (gmlx/platform/cpu_graph.py)
one call is ~15 graph nodes (positions, cos, sin, slices, concatenation), and a
SmolLM2-135M step makes 60 such calls, ~900 of its ~1960 nodes at ~5 us each. At load,
modules of exactly `nn.RoPE` (or its compiled form) become kernel-backed subclasses:
one node per call, each row's rotation a function of its own position only.

The kernels' arithmetic differs from mlx's in the last bits, so they are swapped in
only where the model has already left mlx's bits (its quantized products run in the
kernels, gmlx/platform/cpu_quantized.py); the float32 path stays bit-identical to
mlx-lm. A probe at load checks each module against mx.fast within a tolerance first.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn

from gmlx.platform import cpu_kernels
from gmlx.platform.cpu_graph import FusedRoPE

logger = logging.getLogger(__name__)

# Largest |kernel - mx.fast| accepted at the probe. mlx computes RoPE angles in float32,
# the kernel in double: at position p they differ by up to ~p * 2^-24 radians.
_PROBE_ATOL = 1e-3
_PROBE_POSITIONS = (3, 70, 1100)  # one offset per probe row


class KernelRoPE(nn.RoPE):
    def __call__(self, x: mx.array, offset=0) -> mx.array:
        if not isinstance(offset, mx.array):
            offset = mx.array(offset, dtype=mx.int32)
        return cpu_kernels.rope(x, self.dims, self.traditional, self.base, self.scale, offset)


_SWAPS = {nn.RoPE: KernelRoPE, FusedRoPE: KernelRoPE}


def _probe_input(module: nn.Module) -> tuple[mx.array, tuple]:
    rows = len(_PROBE_POSITIONS)
    x = 3.0 * mx.random.normal((rows, 5, 3, module.dims), key=mx.random.key(1)).transpose(0, 2, 1, 3)  # (B, H, T, D)
    return x, (mx.array(_PROBE_POSITIONS, dtype=mx.int32),)


def _is_close(module: nn.Module) -> bool:
    """Does the kernel module match mlx's own op on a probe (ragged offsets, strided x)?"""
    x, args = _probe_input(module)
    expected = nn.RoPE.__call__(module, x, *args)
    got = _SWAPS[type(module)].__call__(module, x, *args)
    return (mx.abs(got - expected).max() <= _PROBE_ATOL).item()


def _has_ops() -> bool:
    return cpu_kernels.is_built() and hasattr(cpu_kernels.extension(), "rope")


def use_cpu_decode_ops(model: nn.Module) -> int:
    """Swap the model's RoPE modules for kernel-backed ones; how many.

    0 (the model untouched) when the kernels are unavailable or a probe disagrees.
    """
    if not _has_ops():
        return 0
    modules = [m for _, m in model.named_modules() if type(m) in _SWAPS and isinstance(m.base, (int, float))]
    for module in {(type(m), m.dims, m.traditional, m.base, m.scale): m for m in modules}.values():
        if not _is_close(module):
            logger.warning("not using the CPU decode ops: a %s disagrees with mlx's", type(module).__name__)
            return 0
    for module in modules:
        module.__class__ = _SWAPS[type(module)]
    return len(modules)
