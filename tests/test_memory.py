"""glibc malloc tuning (gmlx/platform/memory.py): KV-sized blocks freed stay in the heap for reuse."""

import ctypes
import subprocess
import sys

import pytest

from serving_support import REPO_ROOT, repo_env

_PROBE = """
import ctypes
from gmlx.platform.memory import tune_malloc
print(tune_malloc())
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = MallInfo2
block = libc.malloc(8 << 20)  # a KV buffer's size
libc.free(ctypes.c_void_p(block))
print(libc.mallinfo2().fordblks >= 8 << 20)  # kept in the heap, warm for the next buffer
"""


def _has_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _has_mallinfo2(), reason="glibc >= 2.33 only")
@pytest.mark.parametrize("switch, expected", [(None, ["True", "True"]), ("0", ["False", "False"])])
def test_freed_kv_sized_blocks_stay_in_the_heap_unless_switched_off(switch, expected):
    env = {**repo_env(), **({} if switch is None else {"GMLX_MALLOC_TUNE": switch})}
    if switch is None:
        env.pop("GMLX_MALLOC_TUNE", None)
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60, env=env,
                         cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == expected


def test_a_malformed_switch_fails_start_up():
    from gmlx import config
    from gmlx.config import env_overrides

    with env_overrides({"GMLX_MALLOC_TUNE": "maybe"}), pytest.raises(ValueError, match="GMLX_MALLOC_TUNE"):
        config.validate_settings()


_WARM_PROBE = """
import ctypes
from gmlx.platform.memory import tune_malloc, warm_heap
libc = ctypes.CDLL("libc.so.6")
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = MallInfo2
print(warm_heap(64 << 20), tune_malloc(), warm_heap(64 << 20), warm_heap(32 << 20))
print(libc.mallinfo2().fordblks >= 64 << 20)  # touched, freed, kept
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _has_mallinfo2(), reason="glibc >= 2.33 only")
def test_a_warmed_heap_keeps_its_pages_for_the_first_joins():
    env = repo_env()
    env.pop("GMLX_MALLOC_TUNE", None)
    out = subprocess.run([sys.executable, "-c", _WARM_PROBE], capture_output=True, text=True, timeout=60, env=env,
                         cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    # Nothing before tuning; then the bytes asked, once (a smaller ask finds it warm already).
    assert out.stdout.split() == ["0", "True", str(64 << 20), "0", "True"]


def test_huge_page_spans_cover_every_range_inside_its_mapping_aligned_and_merged():
    import random

    from gmlx.platform.memory import HUGE_PAGE_BYTES as H
    from gmlx.platform.memory import huge_page_spans

    rng = random.Random(0)
    for _ in range(300):
        mappings, at = [], 1 << 40
        for _ in range(rng.randint(1, 4)):  # disjoint, unaligned, sometimes touching
            at += rng.choice([0, rng.randint(1, 8 << 20)])
            size = rng.randint(1 << 12, 24 << 20)
            mappings.append((at, at + size))
            at += size
        ranges = []
        for _ in range(rng.randint(1, 10)):
            map_start, map_end = rng.choice(mappings)
            start = rng.randrange(map_start, map_end)
            ranges.append((start, rng.randint(start + 1, map_end)))
        ranges.append((1 << 39, (1 << 39) + (8 << 20)))  # unmapped: skipped
        spans = huge_page_spans(ranges, mappings)
        assert all(lo % H == 0 and hi % H == 0 and lo < hi for lo, hi in spans)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "sorted, disjoint"
        assert all(any(ms <= lo and hi <= me for ms, me in mappings) for lo, hi in spans), "inside one mapping"
        # Exactly the whole 2 MB pages inside a range's mapping that hold some of its bytes.
        want = set()
        for start, end in ranges:
            for map_start, map_end in mappings:
                if map_start <= start < map_end:
                    for page in range(start - start % H, end, H):
                        if map_start <= page and page + H <= map_end:
                            want.add(page)
        got = {page for lo, hi in spans for page in range(lo, hi, H)}
        assert got == want


_HUGE_PROBE = """
import mlx.core as mx
import numpy as np
from gmlx.platform.memory import move_to_huge_pages, tune_malloc, warm_heap

def huge_bytes(lo, hi):
    # AnonHugePages of the mappings overlapping [lo, hi): holds whether THP is 'madvise' (the
    # call moved them) or 'always' (they were huge already, and the call gained nothing).
    total, is_inside = 0, False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if not fields[0].endswith(":"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            is_inside = start < hi and lo < end
        elif fields[0] == "AnonHugePages:" and is_inside:
            total += int(fields[1]) * 1024
    return total

weights = mx.arange(4 << 20, dtype=mx.float32)  # 16 MB: seven whole huge pages at least
mx.eval(weights)
move_to_huge_pages([weights])
start = np.asarray(weights).ctypes.data
print(huge_bytes(start, start + weights.nbytes) >= 14 << 20,
      (weights == mx.arange(4 << 20, dtype=mx.float32)).all().item())
print(tune_malloc(), warm_heap(64 << 20, is_huge=True) == 64 << 20)
heap = [[int(x, 16) for x in line.split()[0].split("-")] for line in open("/proc/self/maps") if "[heap]" in line]
print(huge_bytes(min(lo for lo, _ in heap), max(hi for _, hi in heap)) >= 48 << 20)
"""


def _can_collapse() -> bool:
    """THP allowed on request (madvise or always) and MADV_COLLAPSE (Linux 6.1)."""
    import os
    import platform
    import re

    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return False
    version = re.match(r"(\d+)\.(\d+)", platform.release())
    return (version is not None and (int(version[1]), int(version[2])) >= (6, 1) and "[never]" not in mode
            and os.path.exists("/proc/self/smaps_rollup"))


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _can_collapse(), reason="Linux >= 6.1 with THP")
def test_weights_and_the_warm_heap_go_onto_huge_pages():
    out = subprocess.run([sys.executable, "-c", _HUGE_PROBE], capture_output=True, text=True, timeout=60,
                         env=repo_env(), cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True"] * 5


def test_a_malformed_huge_pages_switch_fails_start_up():
    from gmlx import config
    from gmlx.config import env_overrides

    with env_overrides({"GMLX_HUGE_PAGES": "sometimes"}), pytest.raises(ValueError, match="GMLX_HUGE_PAGES"):
        config.validate_settings()
