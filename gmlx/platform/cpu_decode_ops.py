"""A decode step's small ops as single graph nodes in gmlx's CPU kernels.

On the CPU backend mx.fast.rope and rms_norm have no kernels: even compiled
(gmlx/platform/cpu_graph.py) one RoPE call is ~12 graph nodes (positions, cos, sin,
slices, concatenation) and one norm 3, and a SmolLM2-135M step makes 60 and 61 of them,
~900 of its ~1960 nodes at ~5 us each. At load, modules of exactly `nn.RoPE` and
`nn.RMSNorm` (or their compiled forms) become kernel-backed subclasses: one node per
call, each row's result a function of that row (and its position) only. Attention
modules follow (gmlx/platform/cpu_attention.py), and MLPs: gate and up as one node and
the SwiGLU as another.

The kernels' arithmetic differs from mlx's in the last bits, so they are swapped in
only where the model has already left mlx's bits (its quantized products run in the
kernels, gmlx/platform/cpu_quantized.py); the float32 path stays bit-identical to
mlx-lm. A probe at load checks each module against mx.fast within a tolerance first.
"""

from __future__ import annotations

import importlib
import logging

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import Llama3RoPE, YarnRoPE

from gmlx.platform import cpu_kernels
from gmlx.platform.cpu_attention import use_kernel_attention
from gmlx.platform.cpu_graph import FusedRMSNorm, FusedRoPE
from gmlx.platform.cpu_quantized import output_dims, project

logger = logging.getLogger(__name__)

# Largest |kernel - mx.fast| accepted at the probe. mlx computes RoPE angles in float32,
# the kernel in double: at position p they differ by up to ~p * 2^-24 radians.
PROBE_ATOL = 1e-3
_PROBE_POSITIONS = (3, 70, 1100)  # one offset per probe row


class KernelRoPE(nn.RoPE):
    def __call__(self, x: mx.array, offset=0) -> mx.array:
        return cpu_kernels.rope(x, self.dims, self.traditional, self.base, self.scale, _offset_array(offset))


class KernelLlama3RoPE(Llama3RoPE):
    """mlx-lm's Llama 3 scaled rope in the kernels: its frequencies as mx.fast.rope takes them."""

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        return cpu_kernels.rope(x, self.dims, self.traditional, 1.0, 1.0, _offset_array(offset), kernel_freqs(self))


class KernelYarnRoPE(YarnRoPE):
    """mlx-lm's YaRN rope in the kernels: its frequencies, and its factor on the rotated features."""

    def __call__(self, x: mx.array, offset=0, scale=1.0, inverse=False) -> mx.array:
        if scale != 1.0 or inverse:  # not what a model's attention asks: mlx-lm's own call
            return super().__call__(x, offset, scale, inverse)
        return cpu_kernels.rope(x, self.dims, self.traditional, 1.0, 1.0, _offset_array(offset), kernel_freqs(self),
                                self.mscale)


def _offset_array(offset) -> mx.array:
    """A rope call's offset as the kernels take it: an int32 array (a scalar or one per row)."""
    return offset if isinstance(offset, mx.array) else mx.array(offset, dtype=mx.int32)


def kernel_freqs(rope: Llama3RoPE | YarnRoPE) -> tuple[float, ...]:
    """A scaled rope's frequencies as floats, read once (a list crosses into the kernels per call)."""
    freqs = rope.__dict__.get("_kernel_freqs")
    if freqs is None:
        freqs = tuple(rope._freqs.astype(mx.float32).tolist())
        object.__setattr__(rope, "_kernel_freqs", freqs)  # outside the module's dict: no parameter
    return freqs


def rope_constants(rope: nn.Module) -> tuple:
    """(dims, traditional, base, scale, freqs, mscale) of a kernel rope, as the fused layer ops take them."""
    if isinstance(rope, YarnRoPE):
        return rope.dims, rope.traditional, 1.0, 1.0, kernel_freqs(rope), float(rope.mscale)
    if isinstance(rope, Llama3RoPE):
        return rope.dims, rope.traditional, 1.0, 1.0, kernel_freqs(rope), 1.0
    return rope.dims, rope.traditional, rope.base, rope.scale, (), 1.0


class KernelRMSNorm(nn.RMSNorm):
    def __call__(self, x: mx.array) -> mx.array:
        return cpu_kernels.rms_norm(x, self["weight"], self.eps)


class _KernelMLP:
    """Mixed into mlx-lm's llama/qwen2/qwen3 MLP: gate and up as one node where their weights
    allow (cpu_quantized.project), then the kernels' SwiGLU (mlx compiles it to a scalar loop
    with a called fma; ~4% of a SmolLM2 step)."""

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = project(x, (self.gate_proj, self.up_proj))
        return self.down_proj(cpu_kernels.swiglu(gate, up))


def _mlp_classes() -> dict[type, type]:
    swaps = {}
    for name in ("llama", "qwen2", "qwen3"):  # mistral loads as llama
        cls = importlib.import_module(f"mlx_lm.models.{name}").MLP
        swaps[cls] = type(f"Kernel{name.capitalize()}MLP", (_KernelMLP, cls), {})
    return swaps


_MLP_SWAPS = _mlp_classes()


def _use_kernel_mlps(model: nn.Module) -> int:
    """Swap the model's MLPs for _KernelMLP after a probe against the class's own call; how many."""
    modules = [m for _, m in model.named_modules() if type(m) in _MLP_SWAPS]
    if not modules:
        return 0
    probe = modules[0]
    x = mx.random.normal((2, 3, output_dims(probe.down_proj)), key=mx.random.key(2))  # (B, T, D)
    expected = type(probe).__call__(probe, x)
    if not cpu_kernels.is_close_to(_MLP_SWAPS[type(probe)].__call__(probe, x), expected, PROBE_ATOL):
        logger.warning("not using the CPU SwiGLU: the MLP disagrees with mlx's")
        return 0
    for module in modules:
        module.__class__ = _MLP_SWAPS[type(module)]
    return len(modules)


_SWAPS = {nn.RoPE: KernelRoPE, FusedRoPE: KernelRoPE, Llama3RoPE: KernelLlama3RoPE, YarnRoPE: KernelYarnRoPE,
          nn.RMSNorm: KernelRMSNorm, FusedRMSNorm: KernelRMSNorm}
# The op each kind reproduces: mlx's own module call.
_REFERENCES = {KernelRoPE: nn.RoPE.__call__, KernelLlama3RoPE: Llama3RoPE.__call__,
               KernelYarnRoPE: YarnRoPE.__call__, KernelRMSNorm: nn.RMSNorm.__call__}


def _probe_input(module: nn.Module) -> tuple[mx.array, tuple]:
    if isinstance(module, nn.RMSNorm):
        return 5.0 * mx.random.normal((2, 3, module["weight"].shape[0]), key=mx.random.key(1)), ()  # (B, T, D)
    rows = len(_PROBE_POSITIONS)
    x = 3.0 * mx.random.normal((rows, 5, 3, module.dims), key=mx.random.key(1)).transpose(0, 2, 1, 3)  # (B, H, T, D)
    return x, (mx.array(_PROBE_POSITIONS, dtype=mx.int32),)


def _is_close(module: nn.Module) -> bool:
    """Does the kernel module match mlx's own op on a probe (ragged offsets, strided x)?"""
    x, args = _probe_input(module)
    kernel = _SWAPS[type(module)]
    expected = _REFERENCES[kernel](module, x, *args)
    got = kernel.__call__(module, x, *args)
    return cpu_kernels.is_close_to(got, expected, PROBE_ATOL)


def _probe_key(module: nn.Module) -> tuple:
    if isinstance(module, (nn.RoPE, Llama3RoPE, YarnRoPE)):
        return (type(module), *rope_constants(module))
    return type(module), module["weight"].shape[0], module.eps


def _has_ops() -> bool:
    return cpu_kernels.is_built() and all(hasattr(cpu_kernels.extension(), op) for op in ("rope", "rms_norm", "swiglu"))


def use_cpu_decode_ops(model: nn.Module) -> int:
    """Swap the model's RoPE, RMSNorm, attention and MLP modules for kernel-backed ones; how many.

    0 (the model untouched) when the kernels are unavailable or a probe disagrees.
    """
    if not _has_ops():
        return 0
    num_swapped = use_kernel_attention(model) + _use_kernel_mlps(model)
    modules = [m for _, m in model.named_modules() if type(m) in _SWAPS]
    for module in {_probe_key(m): m for m in modules}.values():
        if not _is_close(module):
            logger.warning("not using the CPU norm/rope ops: a %s disagrees with mlx's", type(module).__name__)
            return num_swapped
    for module in modules:
        module.__class__ = _SWAPS[type(module)]
    return num_swapped + len(modules)
