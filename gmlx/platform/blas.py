"""A fast BLAS for mlx on Linux, loaded before mlx is first imported.

The `mlx[cpu]` wheel links a bundled reference BLAS. Loading the system OpenBLAS
globally before mlx makes mlx bind OpenBLAS's `cblas_sgemm` instead (~20x on large
matmuls). Before OpenBLAS we load gmlx's interposer (native/gemm_interposer.c), which
takes every `cblas_sgemm` call, runs one-row products (decode) and x @ W.T or x @ W
products of 2-8 rows (a verify, a narrow batch) in streaming kernels that reproduce
OpenBLAS's summation order bit for bit, and passes the rest through.
This module must not import mlx at import time.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import logging
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gmlx import config
from gmlx.platform.blas_select import CoreSelection, select_core
from gmlx.platform.timing import best_of_s

logger = logging.getLogger(__name__)

INSTALL_HINT = "apt-get install libopenblas0-pthread (or run scripts/install_system_deps.sh)"
INTERPOSER_PATH = Path(__file__).resolve().parent / "_gemm_interposer.so"

# Threaded OpenBLAS first (pthreads, then OpenMP), then serial builds.
_SEARCH_GLOBS = (
    "/usr/lib/{triplet}/openblas-pthread/libopenblas.so.0",  # Debian/Ubuntu
    "/usr/lib/{triplet}/openblas-openmp/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",  # Fedora/RHEL: p = pthreads, o = OpenMP
    "/usr/lib64/libopenblaso.so.0",
    "/usr/lib/{triplet}/libopenblas.so.0",  # Debian alternatives link
    "/usr/lib/{triplet}/openblas-serial/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",  # Arch and others
)
_FIND_LIBRARY_NAMES = ("openblasp", "openblas")
_INTERPOSER_STATUS = {
    0: "active",
    1: "loaded, passing every call through (sgemm's order not reproduced on this BLAS)",
    2: "loaded, passing every call through (no AVX2+FMA kernel for this CPU)",
    -1: "no cblas_sgemm in the BLAS",
}
MAX_ROUTED_ROWS = 8  # x @ W.T and x @ W products of up to this many rows run in the interposer
_LAYOUT_NAMES = ("x@W", "x@W.T", "xT@W", "xT@W.T", "A@b", "A@bT", "AT@b", "AT@bT")


@dataclass(slots=True)
class _State:
    is_done: bool = False
    requested: str | None = None  # the BLAS chosen (loaded or not)
    library: str | None = None  # the BLAS loaded, None when none
    source: str | None = None  # GMLX_BLAS_LIB | search | find_library
    blas: ctypes.CDLL | None = None
    interposer: ctypes.CDLL | None = None
    interposer_status: int | None = None  # gmlx_interposer_init's return value
    is_mlx_imported_first: bool = False
    core: CoreSelection | None = None  # the OpenBLAS core choice made before loading it
    notes: list[str] = field(default_factory=list)


_state = _State()


def _triplet() -> str:
    machine = platform.machine()
    return {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}.get(machine, f"{machine}-linux-gnu")


def find_blas_library() -> tuple[str | None, str | None]:
    """The BLAS to load and how it was chosen: (path, source), (None, None) if none."""
    override = config.blas_lib_override()
    if override is not None:
        if override.lower() == "none":
            return None, "GMLX_BLAS_LIB"
        return override, "GMLX_BLAS_LIB"
    for pattern in _SEARCH_GLOBS:
        for path in sorted(glob.glob(pattern.format(triplet=_triplet()))):
            return path, "search"
    for name in _FIND_LIBRARY_NAMES:
        found = ctypes.util.find_library(name)
        if found:
            return found, "find_library"
    return None, None


def _load_interposer() -> ctypes.CDLL | None:
    try:
        is_enabled = config.is_interposer_enabled()
    except ValueError as exc:  # a bad value must not cost the BLAS itself
        logger.warning("%s; the few-row sgemm interposer stays off", exc)
        _state.notes.append(f"interposer off: {exc}")
        return None
    if not is_enabled:
        _state.notes.append("interposer off (GMLX_SGEMV_INTERPOSER=0)")
        return None
    if not INTERPOSER_PATH.exists():
        _state.notes.append(f"interposer not built ({INTERPOSER_PATH.name} missing: reinstall with a C compiler)")
        return None
    try:
        lib = ctypes.CDLL(str(INTERPOSER_PATH), mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        _state.notes.append(f"interposer failed to load: {exc}")
        return None
    lib.gmlx_interposer_init.argtypes = [ctypes.c_char_p]
    lib.gmlx_interposer_set_routing.argtypes = [ctypes.c_int]
    lib.gmlx_interposer_counts.argtypes = [ctypes.POINTER(ctypes.c_long)] * 2
    lib.gmlx_interposer_rows.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p]
    lib.gmlx_interposer_rows_routed.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.gmlx_interposer_blocking.argtypes = [ctypes.POINTER(ctypes.c_long)] * 2 + [
        ctypes.POINTER(ctypes.c_double),
        ctypes.POINTER(ctypes.c_int),
        ctypes.POINTER(ctypes.c_int),
    ]
    return lib


def _load() -> None:
    if not sys.platform.startswith("linux"):
        return  # macOS: mlx uses Accelerate; elsewhere there is nothing to do
    if "mlx.core" in sys.modules:
        _state.is_mlx_imported_first = True
        logger.warning(
            "mlx was imported before gmlx loaded the fast BLAS, so it (and the interposer) cannot "
            "take effect: mlx bound its bundled reference BLAS at import (~20x slower matmuls). "
            "Call gmlx.platform.blas.ensure_fast_blas() before importing mlx or gmlx.engine."
        )
    path, source = find_blas_library()
    _state.requested, _state.source = path, source
    if path is None:
        if source is None:
            logger.warning(
                "no OpenBLAS found: mlx falls back to its reference BLAS (~20x slower matmuls). "
                "Install one: %s; or point GMLX_BLAS_LIB at a BLAS library.",
                INSTALL_HINT,
            )
        return
    if "mlx.core" not in sys.modules:  # else OpenBLAS may be loaded already: too late to choose
        # Read by OpenBLAS at load; workers and the core probes inherit it. A user's value wins.
        try:
            os.environ.setdefault("OPENBLAS_NUM_THREADS", str(config.blas_threads()))
        except ValueError as exc:  # the engine refuses it at start; the BLAS itself still loads
            logger.warning("%s; OpenBLAS keeps its own thread count", exc)
            _state.notes.append(str(exc))
        _state.core = select_core(path, INTERPOSER_PATH)
        if _state.core.choice is not None:
            logger.info("OpenBLAS core: %s", _state.core.choice.reason)
    try:
        ctypes.CDLL(path)  # loadable at all? RTLD_LOCAL keeps it out of the global scope
    except OSError as exc:
        logger.warning("could not load the BLAS %s (%s); install one: %s", path, exc, INSTALL_HINT)
        _state.notes.append(f"could not load {path}: {exc}")
        return
    # The interposer joins the global symbol scope first; reopening the BLAS with
    # RTLD_GLOBAL then appends it after the interposer, so mlx binds our cblas_sgemm.
    interposer = _load_interposer()
    _state.blas = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    _state.library = path
    if interposer is not None:
        _state.interposer = interposer
        _state.interposer_status = interposer.gmlx_interposer_init(path.encode())
        if _state.interposer_status != 0:
            _state.notes.append(f"interposer {_INTERPOSER_STATUS.get(_state.interposer_status, 'failed')}")


def ensure_fast_blas() -> None:
    """Load the fast BLAS (and the interposer) once; never raises."""
    if _state.is_done:
        return
    _state.is_done = True
    try:
        _load()
    except (OSError, AttributeError, ValueError) as exc:  # e.g. a bad GMLX_* value
        logger.warning("fast BLAS setup failed: %s", exc)
        _state.notes.append(f"setup failed: {exc}")


def loaded_sgemm_library() -> ctypes.CDLL | None:
    """The library whose cblas_sgemm mlx binds: the interposer, else the BLAS."""
    return _state.interposer if _state.interposer is not None else _state.blas


def set_routing(is_on: bool) -> bool:
    """Switch the interposer's routing off or back on (tests, benchmarks); returns the new state."""
    if _state.interposer is None or _state.interposer_status != 0:
        return False
    return bool(_state.interposer.gmlx_interposer_set_routing(int(is_on)))


def routes_input_major() -> bool:
    """Whether products with weights stored input-major (x @ W, W's columns contiguous)
    route like x @ W.T: one row and every row count x @ W.T routes, under both drivers."""
    lib = _state.interposer
    if lib is None or not lib.gmlx_interposer_is_routing():
        return False
    if not lib.gmlx_interposer_layouts() & 1:  # bit 0: x@W
        return False
    return all(lib.gmlx_interposer_rows_routed(d, 0) == lib.gmlx_interposer_rows_routed(d, 1) for d in (0, 1))


def routing_counts() -> tuple[int, int]:
    """(calls routed to the interposer's kernels, calls passed to the real sgemm) so far."""
    if _state.interposer is None:
        return 0, 0
    routed, passed = ctypes.c_long(), ctypes.c_long()
    _state.interposer.gmlx_interposer_counts(ctypes.byref(routed), ctypes.byref(passed))
    return routed.value, passed.value


def _openblas_info(blas: ctypes.CDLL) -> dict:
    info: dict = {}
    prefix = "" if hasattr(blas, "openblas_get_config") else "scipy_"  # the numpy/scipy wheels' builds
    for key, symbol, restype in (
        ("openblas_config", "openblas_get_config", ctypes.c_char_p),
        ("openblas_corename", "openblas_get_corename", ctypes.c_char_p),
        ("num_threads", "openblas_get_num_threads", ctypes.c_int),
    ):
        fn = getattr(blas, prefix + symbol, None)  # absent from non-OpenBLAS libraries
        if fn is not None:
            fn.restype = restype
            value = fn()
            info[key] = value.decode() if isinstance(value, bytes) else value
    words = (info.get("openblas_config") or "").split()
    if len(words) > 1 and words[0] == "OpenBLAS":
        info["openblas_version"] = words[1]
    return info


def _interposer_info(lib: ctypes.CDLL) -> dict:
    q, unroll, threads, alpha_mode = ctypes.c_long(), ctypes.c_long(), ctypes.c_int(), ctypes.c_int()
    threshold = ctypes.c_double()
    lib.gmlx_interposer_blocking(*map(ctypes.byref, (q, unroll, threshold, alpha_mode, threads)))
    mask = lib.gmlx_interposer_layouts()
    orders = ctypes.create_string_buffer(2 * MAX_ROUTED_ROWS + 2)
    rows: dict[str, dict[int, str]] = {}
    for driver, is_threaded in (("single", 0), ("threaded", 1)):
        rows_mask = lib.gmlx_interposer_rows(is_threaded, 0, orders)
        rows[driver] = {}
        for m in range(2, MAX_ROUTED_ROWS + 1):
            if rows_mask >> m & 1:
                lib.gmlx_interposer_rows(is_threaded, m, orders)
                rows[driver][m] = orders.value.decode()
    input_major = {driver: [m for m in range(2, MAX_ROUTED_ROWS + 1) if lib.gmlx_interposer_rows_routed(d, 0) >> m & 1]
                   for driver, d in (("single", 0), ("threaded", 1))}
    return {
        "routed_layouts": [name for i, name in enumerate(_LAYOUT_NAMES) if mask >> i & 1],
        "routed_rows_input_major": input_major,  # row counts of x @ W routed (same orders)
        # row count -> sgemm's summation order per row, full tiles / tail ('c' chain, 'p' pairs)
        "routed_rows": rows,
        "blocking": {
            "gemm_q": q.value,
            "unroll": unroll.value,
            "threaded_above_mnk": None if threshold.value < 0 else int(threshold.value),
            "alpha_mode": {1: "fused", 0: "plain", -1: "alpha == 1 only"}[alpha_mode.value],
            "calibrated_threads": threads.value,
        },
    }


def _best_ms(fn, num_reps: int) -> float:
    return 1e3 * best_of_s(fn, num_reps)


def _measure() -> dict:
    import mlx.core as mx  # gmlx is imported, so the BLAS is already in place

    a, b = mx.random.normal((1024, 1024)), mx.random.normal((1024, 1024))
    w, x = mx.random.normal((4096, 4096)), mx.random.normal((1, 4096))
    mx.eval(a, b, w, x)
    out = {"matmul_1024_ms": _best_ms(lambda: mx.eval(a @ b), 5)}
    num_routed_before = routing_counts()[0]
    out["one_row_4096_ms"] = _best_ms(lambda: mx.eval(x @ w.T), 10)
    out["is_routing_effective"] = routing_counts()[0] > num_routed_before
    if out["is_routing_effective"]:
        x4 = mx.random.normal((4, 4096))  # a 4-position verify
        mx.eval(x4)
        out["four_rows_4096_ms"] = _best_ms(lambda: mx.eval(x4 @ w.T), 10)
        set_routing(False)
        try:
            out["one_row_4096_plain_ms"] = _best_ms(lambda: mx.eval(x @ w.T), 10)
            out["four_rows_4096_plain_ms"] = _best_ms(lambda: mx.eval(x4 @ w.T), 10)
        finally:
            set_routing(True)
    return out


def describe_blas(measure: bool = True) -> dict:
    """What BLAS mlx uses here, the interposer's state, and (measure=True) timings."""
    d: dict = {
        "platform": sys.platform,
        "library": _state.library,
        "requested_library": _state.requested,
        "source": _state.source,
        "is_mlx_imported_first": _state.is_mlx_imported_first,
        "interposer_built": INTERPOSER_PATH.exists(),
        "interposer_loaded": _state.interposer is not None,
        "interposer_status": _INTERPOSER_STATUS.get(_state.interposer_status, "not loaded"),
        "is_interposer_active": False,
        "notes": list(_state.notes),
    }
    if _state.core is not None and _state.core.choice is not None:
        d["core_detected"] = _state.core.detected
        d["core_chosen"] = _state.core.choice.core
        d["core_reason"] = _state.core.choice.reason
        d["core_timings_cached"] = _state.core.is_cached
        d["core_timings"] = {c: {"decode_ms": t.decode_ms, "matmul_ms": t.matmul_ms, "is_routing": t.is_routing}
                             for c, t in _state.core.timings.items()}
    if _state.blas is not None:
        d.update(_openblas_info(_state.blas))
    if _state.interposer is not None:
        d["is_interposer_active"] = bool(_state.interposer.gmlx_interposer_is_routing())
        d.update(_interposer_info(_state.interposer))
    if measure:
        d.update(_measure())
    d["num_routed"], d["num_passed"] = routing_counts()
    return d
