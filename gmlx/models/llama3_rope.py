"""Llama 3's RoPE scaling between its two spellings.

A Hugging Face config names it by four numbers (`rope_scaling`: factor, low_freq_factor,
high_freq_factor, original_max_position_embeddings) and mlx-lm builds its rotary frequencies
from them. llama.cpp's converter instead stores the result: one divisor per rotary pair in a
`rope_freqs` tensor. A GGUF of a Llama 3.1/3.2/3.3 model therefore carries the divisors only,
and this module recovers the four numbers, so that the model is mlx-lm's own class with its
own rope, as when loaded from a folder.
"""

from __future__ import annotations

import math

# Every Llama 3.x release uses low_freq_factor 1; with it the other two numbers are determined
# by the divisors of the pairs between the two bands (two or more of them are needed).
LOW_FREQ_FACTOR = 1.0
# Largest relative difference accepted between the stored divisors and those recomputed from
# the recovered numbers (a float32 tensor holds them to ~1e-7).
FACTOR_RTOL = 1e-4


def pair_wavelengths(base: float, num_dims: int) -> list[float]:
    """Each rotary pair's wavelength in positions, 2 pi base^(2i / dims)."""
    return [2 * math.pi * base ** (2 * i / num_dims) for i in range(num_dims // 2)]


def factors_of(scaling: dict, base: float, num_dims: int) -> list[float]:
    """The per-pair divisors of a `rope_scaling` of type llama3: 1 for wavelengths under
    original / high_freq_factor, `factor` over original / low_freq_factor, blended between."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    divisors = []
    for wavelength in pair_wavelengths(base, num_dims):
        if wavelength < original / high:
            divisors.append(1.0)
        elif wavelength > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            divisors.append(1.0 / ((1 - smooth) / factor + smooth))
    return divisors


def scaling_of(divisors: list[float], base: float, source: str) -> dict | None:
    """The llama3 `rope_scaling` whose divisors (from factors_of) these are; None when every
    divisor is 1 (no scaling). ValueError naming `source` when no llama3 scaling gives them."""
    num_dims = 2 * len(divisors)
    factor = max(divisors)
    if factor <= 1.0 and min(divisors) >= 1.0:
        return None
    wavelengths = pair_wavelengths(base, num_dims)
    # Between the bands 1/d = (1 - s)/factor + s with s = (original/wavelength - 1)/(high - 1),
    # linear in (original, high): original/wavelength - s * high = 1 - s, solved by least squares.
    rows = []
    for wavelength, divisor in zip(wavelengths, divisors):
        if math.isclose(divisor, 1.0, rel_tol=FACTOR_RTOL) or math.isclose(divisor, factor, rel_tol=FACTOR_RTOL):
            continue
        smooth = (1 / divisor - 1 / factor) / (1 - 1 / factor)
        rows.append((1 / wavelength, -smooth, 1 - smooth))
    if factor <= 1.0 or len(rows) < 2:
        raise ValueError(f"{source}: rope_freqs ({len(divisors)} divisors, {len(rows)} between the bands) "
                         f"is not a Llama 3 rope scaling gmlx can recover")
    original, high = _least_squares(rows)
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": LOW_FREQ_FACTOR,
               "high_freq_factor": _rounded(high), "original_max_position_embeddings": _rounded(original)}
    if not _matches(scaling, divisors, base):
        scaling.update(high_freq_factor=high, original_max_position_embeddings=original)
    if not _matches(scaling, divisors, base):
        raise ValueError(f"{source}: rope_freqs is not a Llama 3 rope scaling (the closest, {scaling}, "
                         f"gives other divisors)")
    return scaling


def _least_squares(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(x, y) minimizing sum (a x + b y - c)^2 over rows (a, b, c)."""
    aa = sum(a * a for a, _, _ in rows)
    ab = sum(a * b for a, b, _ in rows)
    bb = sum(b * b for _, b, _ in rows)
    ac = sum(a * c for a, _, c in rows)
    bc = sum(b * c for _, b, c in rows)
    determinant = aa * bb - ab * ab
    return (ac * bb - bc * ab) / determinant, (aa * bc - ab * ac) / determinant


def _rounded(value: float) -> float:
    # The configs say 8192 and 4.0; the solve lands within float error of them.
    nearest = round(value)
    return float(nearest) if nearest and abs(value - nearest) <= 1e-6 * abs(value) else value


def _matches(scaling: dict, divisors: list[float], base: float) -> bool:
    recomputed = factors_of(scaling, base, 2 * len(divisors))
    return all(math.isclose(r, d, rel_tol=FACTOR_RTOL) for r, d in zip(recomputed, divisors))
