"""Which format a quantized model computes in on the CPU backend.

Measured 2026-12-01 (scripts/bench_compute_format.py, SmolLM2-135M Q4_1, AMD EPYC 2 cores; see
BENCHMARKS.md): with MLX's own quantized CPU matmul a float32 copy decodes 1.9x faster (Haswell
BLAS core, interposer routing); with gmlx's CPU kernels (gmlx/platform/cpu_kernels.py) the 4-bit
weights decode 1.49x faster than float32. So `auto` keeps the quantized weights when those
kernels are active and computes in float32 otherwise.
"""

from __future__ import annotations

import logging
from typing import Callable

from gmlx.config import cpu_compute_format_setting

logger = logging.getLogger(__name__)

FLOAT32 = "float32"
QUANTIZED = "quantized"

# Probes answering "are fast quantized CPU kernels active?" (a CPU-kernel extension registers one).
_fast_quantized_probes: list[Callable[[], bool]] = []


def register_fast_quantized_kernels(probe: Callable[[], bool]) -> None:
    """Let `auto` keep quantized weights on CPU whenever `probe()` says fast kernels are active."""
    _fast_quantized_probes.append(probe)


def _cpu_kernels_active() -> bool:
    from gmlx.platform import cpu_kernels

    return cpu_kernels.is_available()


def has_fast_quantized_kernels() -> bool:
    return _cpu_kernels_active() or any(probe() for probe in _fast_quantized_probes)


def choose_cpu_compute_format(setting: str | None = None,
                              is_fast_quantized: Callable[[], bool] = has_fast_quantized_kernels) -> tuple[str, str]:
    """(format, reason) for a quantized model on CPU: `float32` or `quantized`."""
    setting = cpu_compute_format_setting() if setting is None else setting
    if setting == FLOAT32:
        return FLOAT32, "GMLX_CPU_COMPUTE_FORMAT=float32"
    if setting == QUANTIZED:
        return QUANTIZED, "GMLX_CPU_COMPUTE_FORMAT=quantized"
    assert setting == "auto", setting
    if is_fast_quantized():
        return QUANTIZED, "auto: gmlx's quantized CPU kernels are active (4-bit decodes 1.5x float32's speed, measured)"
    return FLOAT32, "auto: float32 decodes faster than MLX's quantized CPU matmul (measured)"
