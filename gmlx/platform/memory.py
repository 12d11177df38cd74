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
TRIM_THRESHOLD_BYTES = 1 << 30  # free heap kept for reuse before it goes back to the OS
WARM_HEAP_MAX_BYTES = 512 << 20  # the most warm_heap touches (four 2,800-token SmolLM2 rows)

_is_done = False
_num_warm_bytes = 0  # heap bytes touched and freed so far (warm_heap)


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


def warm_heap(num_bytes: int) -> int:
    """Touch num_bytes of heap once and free them, so the first long joins find warm pages;
    returns the bytes warmed by this call (0 when malloc is not tuned or already warm enough).

    The pages stay with the process (the trim threshold keeps them), like a KV pool reserved
    at start-up: a joining row's buffers then cost a copy, not a copy and page faults."""
    global _num_warm_bytes
    num_bytes = min(num_bytes, WARM_HEAP_MAX_BYTES)
    if not _is_done or num_bytes <= _num_warm_bytes:
        return 0
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    block_bytes = MMAP_THRESHOLD_BYTES // 2  # under the threshold: from the heap
    blocks = []
    for _ in range(-(-num_bytes // block_bytes)):
        block = libc.malloc(block_bytes)
        if not block:
            break
        ctypes.memset(block, 0, block_bytes)
        blocks.append(block)
    for block in reversed(blocks):
        libc.free(ctypes.c_void_p(block))
    warmed = len(blocks) * block_bytes
    _num_warm_bytes = max(_num_warm_bytes, warmed)
    return warmed
