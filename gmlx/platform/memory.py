"""glibc malloc settings that let KV buffers reuse warm pages.

A ragged KV buffer is one array per layer of 1-10 MB, allocated afresh whenever a batch
grows or rows join. glibc serves blocks over its mmap threshold from fresh mappings and
unmaps them at free, so every new buffer page-faults all its pages: on the 2-core VM
0.5-0.6 ms a MB, 90-130 ms to join a 1,500-token row into a SmolLM2 batch (four decode
rounds). From the heap, with freed memory kept up to a trim threshold, the same join
reuses warm pages: 27-41 ms (BENCHMARKS.md, "Prefill packed into decode forwards").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

from gmlx import config

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest: blocks up to it come from the heap
TRIM_THRESHOLD_BYTES = 512 << 20  # free heap kept for reuse before it goes back to the OS

_is_done = False


def tune_malloc() -> bool:
    """Apply the settings once per process (glibc only, GMLX_MALLOC_TUNE=0 skips); True when applied."""
    global _is_done
    if _is_done:
        return True
    if not sys.platform.startswith("linux") or not config.is_malloc_tuned():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    is_applied = (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
                  and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)
    if not is_applied:
        logger.warning("mallopt refused gmlx's thresholds; KV buffers keep page-faulting")
    _is_done = is_applied
    return is_applied
