"""The side-by-side protocol every benchmark script here uses.

Modes take turns within each rep, the order reversed every other rep (ABBA), so each
mode sees the same minutes of this shared, noisy box; a comparison is the median of the
per-rep ratios, never a ratio of medians taken at different times.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


def alternate(modes: Iterable[str], num_reps: int, run: Callable[[str], T],
              after_rep: Callable[[int], None] | None = None) -> dict[str, list[T]]:
    """mode -> its num_reps results of run(mode), taken in ABBA order; after_rep(rep) runs
    after every rep (a DRAM-rate measurement beside each round, say)."""
    modes = list(modes)
    runs: dict[str, list[T]] = {mode: [] for mode in modes}
    for rep in range(num_reps):
        for mode in modes if rep % 2 == 0 else modes[::-1]:
            runs[mode].append(run(mode))
        if after_rep is not None:
            after_rep(rep)
    return runs


def median_ratio(pairs: Iterable[tuple[float, float]]) -> float:
    """The median of a / b over (a, b) pairs measured side by side."""
    return statistics.median(a / b for a, b in pairs)


def median_ratio_of(runs_a: list, runs_b: list, key: str) -> float:
    """median_ratio of one field of two modes' per-rep results (dicts)."""
    return median_ratio((a[key], b[key]) for a, b in zip(runs_a, runs_b))
