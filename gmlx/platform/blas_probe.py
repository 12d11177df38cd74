"""Times one OpenBLAS core in a child process: `python -m gmlx.platform.blas_probe`.

OpenBLAS reads OPENBLAS_CORETYPE once, when it is loaded, so each candidate core is
measured in its own process, loaded exactly as gmlx loads it (interposer included), on
a decode-shaped sequence of products: the seven weights of one ~45 MB transformer
layer (bigger than the L3 of the machines we run on, so read from DRAM as in decode)
at one row three times and at four rows once (a verify), in the layout gmlx would
store them in. Prints one JSON object. Imports no mlx.
"""

from __future__ import annotations

import ctypes
import json
import sys

import numpy as np

from gmlx.platform.timing import best_of_s

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
HIDDEN, KV, FFN = 1024, 256, 2816
LAYER_SHAPES = ((HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN),  # (out, in)
                (FFN, HIDDEN), (FFN, HIDDEN), (HIDDEN, FFN))
ROWS_PER_PASS = (1, 4, 1, 1)
NUM_PASSES = 6


def _sgemm():
    from gmlx.platform import blas

    blas.ensure_fast_blas()
    lib = blas.loaded_sgemm_library()
    if lib is None:
        raise SystemExit("no BLAS loaded")
    fn = lib.cblas_sgemm
    fn.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                        ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    fn.restype = None
    return fn, blas


def _best_ms(fn, num_reps: int) -> float:
    return 1e3 * best_of_s(fn, num_reps)


def measure() -> dict:
    sgemm, blas = _sgemm()
    is_input_major = blas.routes_input_major()  # the layout gmlx's loader would pick
    rng = np.random.default_rng(0)
    weights = []
    for n_out, n_in in LAYER_SHAPES:
        shape = (n_in, n_out) if is_input_major else (n_out, n_in)
        weights.append((n_out, n_in, rng.standard_normal(shape, dtype=np.float32)))
    xs = {m: rng.standard_normal((m, FFN), dtype=np.float32) for m in set(ROWS_PER_PASS)}
    y = np.empty((max(ROWS_PER_PASS), FFN), dtype=np.float32)
    trans_b = NO_TRANS if is_input_major else TRANS

    def decode_pass():
        for m in ROWS_PER_PASS:
            x = xs[m]
            for n_out, n_in, w in weights:
                sgemm(ROW_MAJOR, NO_TRANS, trans_b, m, n_out, n_in, 1.0, x.ctypes.data, FFN, w.ctypes.data,
                      w.shape[1], 0.0, y.ctypes.data, FFN)

    a = rng.standard_normal((1024, 1024), dtype=np.float32)
    c = np.empty_like(a)

    def matmul():
        sgemm(ROW_MAJOR, NO_TRANS, NO_TRANS, 1024, 1024, 1024, 1.0, a.ctypes.data, 1024, a.ctypes.data, 1024,
              0.0, c.ctypes.data, 1024)

    d = blas.describe_blas(measure=False)
    return {
        "core": d.get("openblas_corename") or "unknown",
        "decode_ms": _best_ms(decode_pass, NUM_PASSES),
        "matmul_ms": _best_ms(matmul, 3),
        "is_routing": bool(d["is_interposer_active"]),
        "is_input_major": is_input_major,
    }


if __name__ == "__main__":
    json.dump(measure(), sys.stdout)
