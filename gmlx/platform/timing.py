"""One best-of-N wall-clock timer for the measurements gmlx makes of its machine (BLAS core
choice, doctor, benchmarks): the minimum over repetitions is the figure least moved by
other work on a shared box; and a meter of that other work, for measurements that are cached."""

from __future__ import annotations

import os
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


def _cpu_ticks() -> tuple[int, int, float] | None:
    """(machine busy ticks, machine total ticks, this process's CPU ticks with its waited-for
    children's: probes run in child processes) from Linux's /proc/stat; None elsewhere (macOS)."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    if len(fields) < 8:
        return None
    idle = fields[3] + fields[4]
    own = os.times()
    own_s = own.user + own.system + own.children_user + own.children_system
    return sum(fields) - idle, sum(fields), own_s * os.sysconf("SC_CLK_TCK")


# A measurement that is cached is taken again (or not cached) when other processes used more
# than this share of the machine's CPU meanwhile: on 2 cores one busy neighbour is 0.5.
MAX_OTHER_LOAD = 0.25


class OtherLoad:
    """The share of the machine's CPU time that other processes used while the block ran.

    A best-of-N timing survives brief noise, not a neighbour busy throughout: a cost table
    measured while another process ran both cores read every round 2-3x too slow, and cached,
    it kept that server from ever drafting. share is None where the OS does not say (macOS).
    """

    def __enter__(self) -> OtherLoad:
        self._start = _cpu_ticks()
        self.share: float | None = None
        return self

    def __exit__(self, *exc) -> None:
        end = _cpu_ticks()
        if self._start is None or end is None or end[1] <= self._start[1]:
            return
        busy, total, own = (b - a for a, b in zip(self._start, end))
        self.share = min(max((busy - own) / total, 0.0), 1.0)

    @property
    def is_disturbed(self) -> bool:
        return self.share is not None and self.share > MAX_OTHER_LOAD
