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
