"""Fewer MLX graph nodes per decode step on the CPU backend.

On the CPU, `mx.fast.rms_norm` and `mx.fast.rope` run as decomposed fallbacks: a decode
step of a 120M qwen3 is ~1430 graph nodes, and each costs ~5-10 us to schedule, which
is as much time as a third of the step's weight reading. Compiled, each call's
elementwise chain becomes one fused kernel. Only modules of exactly `nn.RMSNorm` and
`nn.RoPE` are swapped (a subclass may change the arithmetic), and only after a probe
shows the fused results bit-identical to the fallbacks.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn

logger = logging.getLogger(__name__)

_rms_norm = mx.compile(lambda x, weight, eps: mx.fast.rms_norm(x, weight, eps))
_ropes: dict[tuple, object] = {}  # (dims, traditional, base, scale) -> compiled rope


def _rope(dims: int, traditional: bool, base: float, scale: float):
    key = (dims, traditional, base, scale)
    if key not in _ropes:
        _ropes[key] = mx.compile(lambda x, offset: mx.fast.rope(
            x, dims, traditional=traditional, base=base, scale=scale, offset=offset))
    return _ropes[key]


class FusedRMSNorm(nn.RMSNorm):
    def __call__(self, x: mx.array) -> mx.array:
        return _rms_norm(x, self["weight"], self.eps)


class FusedRoPE(nn.RoPE):
    def __call__(self, x: mx.array, offset=0) -> mx.array:
        # An int offset would be a compile-time constant, retraced every step.
        if not isinstance(offset, mx.array):
            offset = mx.array(offset, dtype=mx.int32)
        return _rope(self.dims, self.traditional, self.base, self.scale)(x, offset)


_FUSED = {nn.RMSNorm: FusedRMSNorm, nn.RoPE: FusedRoPE}


def _is_fused_exact(modules: list[nn.Module]) -> bool:
    """Run each fused module beside its fallback on a probe input: bit-identical?"""
    for module in modules:
        fused = _FUSED[type(module)]
        width = module.dims if isinstance(module, nn.RoPE) else module["weight"].shape[0]
        x = 7.0 * mx.random.normal((2, 3, 5, width), key=mx.random.key(0))  # (B, H, T, D)
        args = (mx.array([3, 70]),) if isinstance(module, nn.RoPE) else ()  # one offset per row
        if not mx.array_equal(type(module).__call__(module, x, *args), fused.__call__(module, x, *args)).item():
            return False
    return True


def fuse_cpu_ops(model: nn.Module) -> int:
    """Swap the model's plain RMSNorm and RoPE modules for compiled ones; how many.

    Leaves the model untouched (returns 0) when compiling fails here (MLX's CPU compiler
    needs a C++ toolchain) or the fused results are not bit-identical to the fallbacks.
    """
    modules = [m for _, m in model.named_modules() if type(m) in _FUSED]
    if not modules:
        return 0
    one_of_each = list({type(m): m for m in modules}.values())
    try:
        is_exact = _is_fused_exact(one_of_each)
    except Exception as exc:  # mlx raises RuntimeError/ValueError when its JIT cannot build
        logger.warning("not fusing CPU norm/rope ops: compiling failed (%s)", exc)
        return 0
    if not is_exact:
        logger.warning("not fusing CPU norm/rope ops: fused results differ from the fallbacks")
        return 0
    for module in modules:
        module.__class__ = _FUSED[type(module)]
    return len(modules)
