"""Where the engine's memory lives: glibc malloc settings that let KV buffers reuse warm
pages, and transparent huge pages under the weights and that warm heap (both are read every
decode step; on 4 KB pages every 4 KB costs a TLB miss).

A ragged KV buffer is one array per layer of 1-10 MB, allocated afresh whenever a batch
grows or rows join. glibc serves blocks over its mmap threshold from fresh mappings and
unmaps them at free, so every new buffer page-faults all its pages: on the 2-core VM
0.5-0.6 ms a MB, 90-130 ms to join a 1,500-token row into a SmolLM2 batch (four decode
rounds). From the heap, with freed memory kept up to a trim threshold, the same join
reuses warm pages: 27-41 ms (BENCHMARKS.md, "Prefill packed into decode forwards").
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import functools
import logging
import re
import sys
from collections.abc import Iterable

from gmlx import config

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest: blocks up to it come from the heap
TRIM_THRESHOLD_BYTES = 1 << 30  # free heap kept for reuse before it goes back to the OS
WARM_HEAP_MAX_BYTES = 512 << 20  # the most warm_heap touches (four 2,800-token SmolLM2 rows)

_is_done = False
_num_warm_bytes = 0  # heap bytes touched and freed so far (warm_heap)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, loaded once (find_library runs ldconfig: ~2.4 ms a call); None where absent."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    libc.malloc.restype = ctypes.c_void_p
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def tune_malloc() -> bool:
    """Apply the settings once per process (glibc only, GMLX_MALLOC_TUNE=0 skips); True when applied."""
    global _is_done
    if _is_done:
        return True
    if not sys.platform.startswith("linux") or not config.is_malloc_tuned():
        return False
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:  # not glibc (musl has no mallopt)
        return False
    is_applied = (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
                  and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)
    if not is_applied:
        logger.warning("mallopt refused gmlx's thresholds; KV buffers keep page-faulting")
    _is_done = is_applied
    return is_applied


def warm_heap(num_bytes: int, is_huge: bool = False) -> int:
    """Touch num_bytes of heap once and free them, so the first long joins find warm pages;
    returns the bytes warmed by this call (0 when malloc is not tuned or already warm enough).

    The pages stay with the process (the trim threshold keeps them), like a KV pool reserved
    at start-up: a joining row's buffers then cost a copy, not a copy and page faults. With
    is_huge they are 2 MB pages: attention reads a long row's KV every step, as it does weights."""
    global _num_warm_bytes
    num_bytes = min(num_bytes, WARM_HEAP_MAX_BYTES)
    if not _is_done or num_bytes <= _num_warm_bytes:
        return 0
    libc = _libc()
    block_bytes = MMAP_THRESHOLD_BYTES // 2  # under the threshold: from the heap
    blocks = []
    for _ in range(-(-num_bytes // block_bytes)):
        block = libc.malloc(block_bytes)
        if not block:
            break
        blocks.append(block)
    if is_huge:  # before the first touch, so the pages fault in huge: nothing to collapse
        advise_huge_pages([(block, block + block_bytes) for block in blocks], is_collapsed=False)
    for block in blocks:
        ctypes.memset(block, 0, block_bytes)
    for block in reversed(blocks):
        libc.free(ctypes.c_void_p(block))
    warmed = len(blocks) * block_bytes
    _num_warm_bytes = max(_num_warm_bytes, warmed)
    return warmed


_MADV_HUGEPAGE = 14  # linux/mman.h
_MADV_COLLAPSE = 25  # Linux 6.1+: collapse now rather than when khugepaged comes by
HUGE_PAGE_BYTES = 2 << 20


def huge_page_spans(ranges: Iterable[tuple[int, int]], mappings: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The 2 MB-aligned (start, end) spans covering the byte ranges, merged within a mapping and
    clipped to its whole 2 MB pages: Linux refuses to collapse a span that reaches past one."""
    mappings = sorted(mappings)
    spans: list[list[int]] = []  # [lo, hi, mapping index]
    for start, end in sorted(ranges):
        at = bisect.bisect_right(mappings, (start, float("inf"))) - 1
        if at < 0 or not mappings[at][0] <= start < mappings[at][1]:
            continue  # not mapped: nothing to advise
        map_start, map_end = mappings[at]
        lo = max(start - start % HUGE_PAGE_BYTES, -(-map_start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES)
        hi = min(-(-end // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES, map_end - map_end % HUGE_PAGE_BYTES)
        if lo >= hi:
            continue
        if spans and spans[-1][2] == at and lo <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], hi)
        else:
            spans.append([lo, hi, at])
    return [(lo, hi) for lo, hi, _ in spans]


def process_mappings() -> list[tuple[int, int]]:
    """(start, end) of this process's memory mappings (/proc/self/maps; empty where absent)."""
    try:
        lines = open("/proc/self/maps").read().splitlines()
    except OSError:
        return []
    return [tuple(int(x, 16) for x in line.split(maxsplit=1)[0].split("-")) for line in lines]


def anon_huge_page_bytes() -> int:
    """This process's anonymous memory on transparent huge pages (0 where Linux does not say)."""
    try:
        rollup = open("/proc/self/smaps_rollup").read()
    except OSError:
        return 0
    found = re.search(r"^AnonHugePages:\s+(\d+) kB", rollup, re.MULTILINE)
    return int(found.group(1)) * 1024 if found else 0


def huge_pages_status() -> str:
    """What `gmlx doctor` says of transparent huge pages: Linux's mode and what gmlx does with it."""
    if not config.is_huge_pages_enabled():
        return "off (GMLX_HUGE_PAGES=0): weights and KV on 4 KB pages"
    try:
        modes = open("/sys/kernel/mm/transparent_hugepage/enabled").read().split()
    except OSError:
        return "none on this system: weights and KV on the system's pages"
    mode = next((m.strip("[]") for m in modes if m.startswith("[")), "unknown")
    if mode == "never":
        return ("never (Linux's setting): weights and KV stay on 4 KB pages; "
                "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled lets gmlx ask for them")
    return f"{mode}: on the CPU backend the weights and the KV heap are moved onto 2 MB pages"


def advise_huge_pages(ranges: Iterable[tuple[int, int]], is_collapsed: bool) -> None:
    """Ask Linux for 2 MB pages under the whole huge pages of these byte ranges: collapsed now
    when is_collapsed (memory already touched), else as the pages are first touched."""
    if not sys.platform.startswith("linux"):
        return
    libc = _libc()
    if libc is None:
        return
    for lo, hi in huge_page_spans(ranges, process_mappings()):
        if libc.madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0 and is_collapsed:
            libc.madvise(lo, hi - lo, _MADV_COLLAPSE)  # before 6.1 EINVAL: khugepaged collapses later


def move_to_huge_pages(arrays) -> int:
    """Back the memory holding these evaluated mlx arrays with 2 MB pages; returns the bytes
    of huge pages the process gained (0 off Linux, or where THP is off).

    Decode reads every weight once a step; on 4 KB pages that is a TLB miss every 4 KB, and
    the weights of a 135M model at 4 bits measured 1.16-1.17x faster on huge pages (BENCHMARKS.md).
    The spans are rounded out to 2 MB within their mappings, so heap memory next to the
    weights comes along."""
    import numpy as np

    if not sys.platform.startswith("linux"):
        return 0
    ranges = []
    for array in arrays:
        try:
            start = np.asarray(array).ctypes.data  # a view of the array's buffer, not a copy
        except (TypeError, ValueError, RuntimeError):  # a dtype numpy cannot view (bfloat16)
            continue
        ranges.append((start, start + array.nbytes))
    before_bytes = anon_huge_page_bytes()
    advise_huge_pages(ranges, is_collapsed=True)
    gained_bytes = max(0, anon_huge_page_bytes() - before_bytes)
    # Weights packed by the CPU extension fault in on huge pages already: only the rest move now.
    logger.info("weights on huge pages: %.0f MB moved now for %.0f MB of weights", gained_bytes / 1e6,
                sum(end - start for start, end in ranges) / 1e6)
    return gained_bytes
