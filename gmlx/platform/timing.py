"""One best-of-N wall-clock timer for the measurements gmlx makes of its machine (BLAS core
choice, doctor, benchmarks): the minimum over repetitions is the figure least moved by
other work on a shared box."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_of_s(fn: Callable[[], object], num_reps: int, num_warmup: int = 1,
              clock: Callable[[], float] = time.perf_counter) -> float:
    """The shortest of num_reps timed calls of fn, in seconds of `clock` (wall time, or
    time.process_time for CPU time), after num_warmup untimed ones."""
    for _ in range(num_warmup):
        fn()
    best = float("inf")
    for _ in range(num_reps):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best
