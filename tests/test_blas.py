from gmlx.platform.blas import ensure_fast_blas

ensure_fast_blas()  # the fast BLAS and the interposer must load before mlx

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time

import mlx.core as mx  # noqa: E402
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gmlx import config
from gmlx.config import env_overrides
from gmlx.platform import blas, doctor

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the BLAS loader is Linux-only")

ROW_MAJOR, COL_MAJOR, NO_TRANS, TRANS = 101, 102, 111, 112
SGEMM_ARGTYPES = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                       ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def loaded_blas() -> dict:
    """describe_blas() where an OpenBLAS is loaded; skips (with the fix) where none is."""
    d = blas.describe_blas(measure=False)
    if d["library"] is None:
        pytest.skip("no OpenBLAS on this machine (apt-get install libopenblas0-pthread)")
    return d


@pytest.fixture(scope="module")
def sgemms(loaded_blas):
    """(interposed cblas_sgemm, the BLAS's own cblas_sgemm) as ctypes functions; skips
    where the interposer cannot route on this BLAS core (test_each_core runs them under
    every core the CPU can execute)."""
    d = loaded_blas
    if not d["interposer_built"]:
        pytest.skip("interposer not built (no C compiler at install)")
    if not d["is_interposer_active"]:
        pytest.skip(f"the interposer does not route on OpenBLAS core {d.get('openblas_corename')}: "
                    f"{d['interposer_status']} (it reproduces the Haswell/Zen kernels' order)")
    routed = ctypes.CDLL(str(blas.INTERPOSER_PATH)).cblas_sgemm
    real = ctypes.CDLL(d["library"]).cblas_sgemm  # dlsym on the BLAS's handle: its own symbol
    for fn in (routed, real):
        fn.argtypes, fn.restype = SGEMM_ARGTYPES, None
    return routed, real


def bits(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.uint32)  # NaN-safe, sign-of-zero-exact


def make_operands(rng, order, ta, tb, m, n, k, pad):
    """A, B, C as stored for cblas_sgemm, each with `pad` extra elements per leading dimension."""
    is_row = order == ROW_MAJOR
    a_shape = (k, m) if (ta == TRANS) == is_row else (m, k)  # (outer, inner) in memory
    b_shape = (n, k) if (tb == TRANS) == is_row else (k, n)
    c_shape = (m, n) if is_row else (n, m)
    a, b, c = (rng.standard_normal((s[0], s[1] + pad), dtype=np.float32) for s in (a_shape, b_shape, c_shape))
    return a, b, c


def call(fn, order, ta, tb, m, n, k, alpha, a, b, beta, c):
    fn(order, ta, tb, m, n, k, alpha, a.ctypes.data, a.shape[1], b.ctypes.data, b.shape[1], beta,
       c.ctypes.data, c.shape[1])


one_row_shapes = st.one_of(
    st.tuples(st.just(1), st.integers(1, 300), st.integers(1, 1100)),  # M == 1
    st.tuples(st.integers(1, 300), st.just(1), st.integers(1, 1100)),  # N == 1
    st.tuples(st.just(1), st.integers(300, 1300), st.integers(300, 700)),  # threaded sgemm driver
    st.tuples(st.integers(2, 8), st.integers(1, 300), st.integers(1, 1100)),  # 2-8 rows
    st.tuples(st.integers(2, 8), st.integers(300, 1300), st.integers(300, 700)),  # 2-8 rows, threaded
    st.tuples(st.integers(2, 8), st.integers(2, 8), st.integers(1, 400)),  # 2-8 rows both ways
    st.tuples(st.integers(1, 8), st.integers(1024, 1600), st.integers(1024, 1400)),  # our two-thread split
)


def is_routed_rows(d: dict, order: int, ta: int, tb: int, m: int, n: int, k: int) -> bool:
    """Whether the interposer reports a routed case for an x @ W.T- or x @ W-shaped call
    of 2-8 rows (W's rows or its columns contiguous)."""
    rows, other, is_w_rows = (m, n, tb == TRANS) if order == ROW_MAJOR else (n, m, ta == TRANS)
    if not (2 <= rows <= blas.MAX_ROUTED_ROWS and other > 1):
        return False
    threshold = d["blocking"]["threaded_above_mnk"]
    is_threaded = d["num_threads"] > 1 and threshold is not None and m * n * k > threshold
    routed = d["routed_rows"] if is_w_rows else d["routed_rows_input_major"]
    return rows in routed["threaded" if is_threaded else "single"]


@SETTINGS
@given(shape=one_row_shapes, order=st.sampled_from([ROW_MAJOR, COL_MAJOR]),
       ta=st.sampled_from([NO_TRANS, TRANS]), tb=st.sampled_from([NO_TRANS, TRANS]), pad=st.integers(0, 5),
       alpha=st.sampled_from([1.0, 0.5, -1.75]), beta=st.sampled_from([0.0, 1.0, -0.3]), seed=st.integers(0, 2**16))
def test_direct_sgemm_calls_are_bit_identical(sgemms, shape, order, ta, tb, pad, alpha, beta, seed):
    routed_fn, real_fn = sgemms
    m, n, k = shape
    a, b, c = make_operands(np.random.default_rng(seed), order, ta, tb, m, n, k, pad)
    if beta == 0.0:
        c[:] = np.nan  # beta == 0: C must not be read
    c_real, c_routed = c.copy(), c.copy()
    num_routed = blas.routing_counts()[0]
    call(real_fn, order, ta, tb, m, n, k, alpha, a, b, beta, c_real)
    call(routed_fn, order, ta, tb, m, n, k, alpha, a, b, beta, c_routed)
    assert np.array_equal(bits(c_real), bits(c_routed))
    d = blas.describe_blas(measure=False)
    if m == 1 or n == 1 or is_routed_rows(d, order, ta, tb, m, n, k):  # it did go through our kernels
        assert blas.routing_counts()[0] == num_routed + 1


def products(rng, rows: int, k: int, n: int, layout: str):
    """mlx operands for a (rows, k) @ (k, n) product laid out as `layout` says."""
    x = mx.array(rng.standard_normal((rows, k), dtype=np.float32))
    if layout == "x@W.T":  # a Linear layer
        return x, mx.array(rng.standard_normal((n, k), dtype=np.float32)).T
    if layout == "x@W":
        return x, mx.array(rng.standard_normal((k, n), dtype=np.float32))
    if layout == "sliced":  # leading dimensions larger than the row: W[:, :k] of a wider W
        wide = mx.array(rng.standard_normal((n, k + 7), dtype=np.float32))
        return x, wide[:, :k].T
    if layout == "strided rows":  # every other row of W
        tall = mx.array(rng.standard_normal((2 * n, k), dtype=np.float32))
        return x, tall[::2].T
    if layout == "xT":  # x itself a transposed view
        return mx.array(rng.standard_normal((k, rows), dtype=np.float32)).T, mx.array(
            rng.standard_normal((k, n), dtype=np.float32))
    assert layout == "matrix@vector"  # N == 1
    return mx.array(rng.standard_normal((n, k), dtype=np.float32)), x[:1].T


def run_both(fn):
    blas.set_routing(False)
    try:
        plain = np.array(fn())
    finally:
        blas.set_routing(True)
    num_routed = blas.routing_counts()[0]
    routed = np.array(fn())
    return plain, routed, blas.routing_counts()[0] - num_routed


@SETTINGS
@given(rows=st.integers(1, 8), k=st.integers(1, 700), n=st.integers(1, 300), seed=st.integers(0, 2**16),
       layout=st.sampled_from(["x@W.T", "x@W", "sliced", "strided rows", "xT", "matrix@vector"]))
def test_mlx_products_are_bit_identical(sgemms, rows, k, n, layout, seed):
    a, b = products(np.random.default_rng(seed), rows, k, n, layout)
    mx.eval(a, b)
    plain, routed, num_routed = run_both(lambda: mx.eval(out := a @ b) or out)
    assert np.array_equal(bits(plain), bits(routed))
    d = blas.describe_blas(measure=False)
    is_rows = layout in ("x@W.T", "x@W") and is_routed_rows(
        d, ROW_MAJOR, NO_TRANS, TRANS if layout == "x@W.T" else NO_TRANS, rows, n, k)
    if a.shape[0] == 1 or b.shape[1] == 1 or is_rows:
        assert num_routed >= 1, "a one-row or few-row mlx product did not reach the interposer"


def test_decode_shaped_products_route_and_match(sgemms):
    rng = np.random.default_rng(0)
    # attention over a cache: (B, H, 1, D) @ (B, H, D, L), then (B, H, 1, L) @ (B, H, L, D)
    q = mx.array(rng.standard_normal((2, 4, 1, 64), dtype=np.float32))
    keys = mx.array(rng.standard_normal((2, 4, 333, 64), dtype=np.float32))
    values = mx.array(rng.standard_normal((2, 4, 333, 64), dtype=np.float32))
    w = mx.array(rng.standard_normal((1536, 1024), dtype=np.float32))  # big enough for two threads
    w_input_major = mx.contiguous(w.T).T  # a Linear weight as gmlx stores it on CPU
    x = mx.array(rng.standard_normal((1, 1, 1024), dtype=np.float32))
    mx.eval(q, keys, values, w, w_input_major, x)
    for fn in (lambda: (q @ keys.swapaxes(-1, -2)) @ values, lambda: x @ w.T, lambda: x @ w_input_major.T):
        plain, routed, num_routed = run_both(lambda: mx.eval(out := fn()) or out)
        assert np.array_equal(bits(plain), bits(routed))
        assert num_routed >= 1


def test_counters_move(sgemms):
    x, w = mx.ones((1, 96)), mx.ones((80, 96))
    x3, x16 = mx.ones((3, 96)), mx.ones((16, 96))
    mx.eval(x, w, x3, x16)
    counts = [blas.routing_counts()]
    for product in (x @ w.T, x3 @ w.T, x16 @ w.T):
        mx.eval(product)
        counts.append(blas.routing_counts())
    deltas = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(counts, counts[1:])]
    assert deltas == [(1, 0), (1, 0), (0, 1)]  # one row, three rows routed; sixteen passed


def test_verify_shaped_products_route_and_match(sgemms):
    """A speculative verify: 2-8 positions through every Linear of a layer, both drivers."""
    rng = np.random.default_rng(1)
    d = blas.describe_blas(measure=False)
    for rows in range(2, blas.MAX_ROUTED_ROWS + 1):
        for n, k in ((256, 256), (1100, 1024), (2051, 333)):
            x = mx.array(rng.standard_normal((1, rows, k), dtype=np.float32))
            w = mx.array(rng.standard_normal((n, k), dtype=np.float32))
            for weight, tb in ((w, TRANS), (mx.contiguous(w.T).T, NO_TRANS)):  # mlx-lm's, input-major
                mx.eval(x, weight)
                plain, routed, num_routed = run_both(lambda: mx.eval(out := x @ weight.T) or out)
                assert np.array_equal(bits(plain), bits(routed)), (rows, n, k, tb)
                assert (num_routed >= 1) == is_routed_rows(d, ROW_MAJOR, NO_TRANS, tb, rows, n, k), (rows, n, k, tb)


def random_call(rng):
    """A random routed-size call: one row, or 2-8 rows of x @ W.T or x @ W, big enough to split."""
    m, n, k = int(rng.choice([1, 1, 2, 4, 7])), int(rng.integers(64, 1400)), int(rng.integers(1024, 1200))
    order, ta, tb = (int(rng.choice(choices)) for choices in ([ROW_MAJOR, COL_MAJOR], [NO_TRANS, TRANS],
                                                               [NO_TRANS, TRANS]))
    if order == COL_MAJOR:  # the same product as seen column-major
        m, n, ta, tb = n, m, tb, ta
    return (order, ta, tb, m, n, k, float(rng.choice([1.0, 0.5])), float(rng.choice([0.0, 1.0])))


def check_calls(routed_fn, real_fn, seed: int, num_calls: int) -> list:
    """Run num_calls random calls through both sgemms; the arguments of those that differ."""
    rng = np.random.default_rng(seed)
    bad = []
    for _ in range(num_calls):
        order, ta, tb, m, n, k, alpha, beta = random_call(rng)
        a, b, c = make_operands(rng, order, ta, tb, m, n, k, int(rng.integers(0, 3)))
        c_real, c_routed = c.copy(), c.copy()
        call(real_fn, order, ta, tb, m, n, k, alpha, a, b, beta, c_real)
        call(routed_fn, order, ta, tb, m, n, k, alpha, a, b, beta, c_routed)
        if not np.array_equal(bits(c_real), bits(c_routed)):
            bad.append((order, ta, tb, m, n, k, alpha, beta))
    return bad


def test_concurrent_callers_are_bit_identical(sgemms):
    """Several threads calling at once: one gets the helper threads, the rest run alone."""
    routed_fn, real_fn = sgemms
    results = [None] * 4

    def worker(i):
        results[i] = check_calls(routed_fn, real_fn, seed=100 + i, num_calls=25)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert all(r == [] for r in results), results


def test_forked_child_routes_with_fresh_helpers(sgemms):
    """The helper threads do not survive fork(): a child must start its own, not wait on ghosts."""
    routed_fn, real_fn = sgemms
    assert check_calls(routed_fn, real_fn, seed=7, num_calls=3) == []  # the parent's helpers exist
    num_routed = blas.routing_counts()[0]
    pid = os.fork()
    if pid == 0:  # the child: exit status says whether it matched and routed
        code = 1
        try:
            is_ok = check_calls(routed_fn, real_fn, seed=8, num_calls=6) == []
            code = 0 if is_ok and blas.routing_counts()[0] >= num_routed + 6 else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 120
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung in a routed sgemm")
    assert os.waitstatus_to_exitcode(done[1]) == 0


def test_describe_blas(sgemms):
    d = blas.describe_blas()
    assert os.path.exists(d["library"]) and d["source"] in ("search", "find_library", "GMLX_BLAS_LIB")
    assert d["openblas_version"].count(".") == 2 and d["num_threads"] >= 1
    assert d["is_interposer_active"] and d["is_routing_effective"] and not d["is_mlx_imported_first"]
    assert "x@W.T" in d["routed_layouts"] and d["blocking"]["gemm_q"] > 0
    assert 0 < d["matmul_1024_ms"] < 350, "1024^2 matmul as slow as the reference BLAS"
    assert d["one_row_4096_plain_ms"] > 0 and d["num_routed"] > 0
    report = doctor.format_blas_report(d)
    assert d["library"] in report and "interposer: active" in report


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env}, check=True)


FAST_BLAS = "from gmlx.platform.blas import ensure_fast_blas; ensure_fast_blas()"
PRODUCT = """
import hashlib, json, numpy as np
{first}
import mlx.core as mx
from gmlx.platform.blas import describe_blas
rng = np.random.default_rng(7)
x = mx.array(rng.standard_normal((1, 777), dtype=np.float32))
w = mx.array(rng.standard_normal((1500, 777), dtype=np.float32))
y = np.array(x @ w.T)
d = describe_blas(measure=False)
print(json.dumps({{"bits": hashlib.sha256(y.tobytes()).hexdigest(),
                  "active": d["is_interposer_active"], "library": d["library"],
                  "mlx_first": d["is_mlx_imported_first"], "routed": d["num_routed"]}}))
"""


def test_interposer_off_matches_in_another_process(loaded_blas):
    on = json.loads(run_python(PRODUCT.format(first=FAST_BLAS)).stdout)
    off = json.loads(run_python(PRODUCT.format(first=FAST_BLAS), GMLX_SGEMV_INTERPOSER="0").stdout)
    assert on["active"] == loaded_blas["is_interposer_active"]
    assert on["routed"] >= 1 or not on["active"]
    assert not off["active"] and off["routed"] == 0 and off["library"] == on["library"]
    assert on["bits"] == off["bits"]


def test_mlx_imported_first_warns_and_no_blas_is_not_fatal(loaded_blas):
    late = run_python(PRODUCT.format(first="import mlx.core; " + FAST_BLAS))
    assert json.loads(late.stdout)["mlx_first"] and "imported before gmlx" in late.stderr
    none = json.loads(run_python(PRODUCT.format(first=FAST_BLAS), GMLX_BLAS_LIB="none").stdout)
    assert none["library"] is None and not none["active"]


def test_blas_threads_default_and_a_malformed_setting(loaded_blas):
    threads = "from gmlx.platform.blas import describe_blas; print(describe_blas(measure=False)['num_threads'])"
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "GMLX_BLAS_THREADS")}
    done = subprocess.run([sys.executable, "-c", f"{FAST_BLAS}\n{threads}"], capture_output=True, text=True,
                          timeout=120, env=env, check=True)
    assert int(done.stdout.split()[-1]) == max(1, len(os.sched_getaffinity(0)) - 1)
    # A bad value is named, and the BLAS still loads (the engine refuses the value at start).
    bad = json.loads(run_python(PRODUCT.format(first=FAST_BLAS), GMLX_BLAS_THREADS="many").stdout)
    assert bad["library"] == loaded_blas["library"]
    with pytest.raises(ValueError, match="GMLX_BLAS_THREADS"):
        with env_overrides({"GMLX_BLAS_THREADS": "many"}):
            config.validate_settings()


CORE = """
import json
from gmlx.platform.blas import describe_blas, ensure_fast_blas
ensure_fast_blas()
d = describe_blas(measure=False)
print(json.dumps({k: d.get(k) for k in ("core_detected", "core_chosen", "core_reason", "core_timings_cached",
                                         "core_timings", "openblas_corename", "is_interposer_active")}))
"""


def test_startup_core_choice_is_measured_cached_and_inherited(loaded_blas, tmp_path):
    from gmlx.platform.blas_cores import is_fallback
    from gmlx.platform.blas_select import cpu_flags

    env = {"GMLX_CACHE_DIR": str(tmp_path), "OPENBLAS_CORETYPE": "", "GMLX_BLAS_CORE_CHOSEN": ""}
    for _ in range(3):  # timings taken while other processes were busy are not cached, and say so
        done = run_python(CORE, **env)
        first = json.loads(done.stdout)
        timings = first["core_timings"]
        assert first["core_detected"] in timings and not first["core_timings_cached"]
        if (tmp_path / "blas_cores.json").exists():
            break
        assert "OpenBLAS core timings not cached: other processes used" in done.stderr, done.stderr
    else:
        pytest.skip("other processes kept the CPU busy through three timings of the cores")
    fastest = min(t["decode_ms"] for t in timings.values())
    running = first["openblas_corename"]
    assert timings[running]["decode_ms"] <= 1.031 * fastest, first["core_reason"]
    assert not is_fallback(running, cpu_flags()) or timings[running]["decode_ms"] <= 1.031 * fastest
    again = json.loads(run_python(CORE, **env).stdout)  # from the cache, same choice
    assert again["core_timings_cached"] and again["openblas_corename"] == running
    if first["core_chosen"]:  # a child of a gmlx process inherits the choice without measuring
        child = json.loads(run_python(CORE, **{**env, "GMLX_CACHE_DIR": str(tmp_path / "empty"),
                                                "OPENBLAS_CORETYPE": first["core_chosen"],
                                                "GMLX_BLAS_CORE_CHOSEN": first["core_chosen"]}).stdout)
        assert child["openblas_corename"] == running and "parent" in child["core_reason"]
    user = json.loads(run_python(CORE, **{**env, "OPENBLAS_CORETYPE": "Prescott"}).stdout)
    assert user["openblas_corename"] == "Prescott" and "set by the user" in user["core_reason"]
    assert not user["is_interposer_active"]  # Prescott's order is not reproduced: passes through


def test_a_user_core_the_cpu_cannot_execute_is_ignored_not_loaded(loaded_blas, tmp_path):
    """OpenBLAS forced onto kernels the CPU lacks dies of an illegal instruction as it loads
    (SkylakeX on an AVX2 EPYC): gmlx drops such a setting, says so, and chooses as if unset."""
    import platform

    from gmlx.platform.blas_cores import X86_CORE_FLAGS, is_x86, unrunnable_reason
    from gmlx.platform.blas_select import cpu_flags

    if not is_x86(platform.machine()):
        pytest.skip(f"OpenBLAS x86-64 cores do not apply on {platform.machine()}")
    unrunnable = [core for core in X86_CORE_FLAGS if unrunnable_reason(core, cpu_flags())]
    if not unrunnable:
        pytest.skip("this CPU executes every OpenBLAS x86-64 core gmlx knows")
    core = unrunnable[-1]
    done = run_python(CORE, GMLX_CACHE_DIR=str(tmp_path), OPENBLAS_CORETYPE=core, GMLX_BLAS_CORE_CHOSEN="")
    report = json.loads(done.stdout)
    assert report["openblas_corename"] != core
    assert report["core_reason"].startswith(f"OPENBLAS_CORETYPE={core} ignored (this CPU cannot execute")
    assert f"OPENBLAS_CORETYPE={core} ignored" in done.stderr


# OpenBLAS x86-64 cores whose kernels the BLAS-dependent tests run under, one process each.
TESTED_CORES = ("Prescott", "Haswell", "Zen", "SkylakeX", "Cooperlake")
BLAS_TEST_FILES = ("tests/test_blas.py", "tests/test_cpu_layout.py", "tests/test_cpu_graph.py")


@pytest.mark.slow
@pytest.mark.parametrize("core", TESTED_CORES)
def test_each_core(loaded_blas, core):
    """The BLAS-dependent tests under each core the CPU can execute, so one machine
    exercises as many kernel paths (and interposer decisions) as it can."""
    import platform

    from gmlx.platform.blas_cores import is_x86, unrunnable_reason
    from gmlx.platform.blas_select import cpu_flags

    if os.environ.get("GMLX_TEST_CORE"):
        pytest.skip("already running under one forced core")
    if not is_x86(platform.machine()):
        pytest.skip(f"OpenBLAS x86-64 cores do not apply on {platform.machine()}")
    refusal = unrunnable_reason(core, cpu_flags())
    if refusal is not None:
        pytest.skip(refusal)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *BLAS_TEST_FILES],
                         cwd=repo, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "OPENBLAS_CORETYPE": core, "GMLX_BLAS_CORE_CHOSEN": "",
                              "GMLX_TEST_CORE": core})
    tail = "\n".join(out.stdout.splitlines()[-25:])
    assert out.returncode == 0, f"BLAS tests under OPENBLAS_CORETYPE={core}:\n{tail}\n{out.stderr[-2000:]}"


def test_forced_core_is_the_one_running(loaded_blas):
    core = os.environ.get("GMLX_TEST_CORE")
    if not core:
        pytest.skip("runs inside test_each_core, under a forced core")
    assert loaded_blas["openblas_corename"] == core
    report = doctor.format_blas_report(blas.describe_blas(measure=True))
    assert f"core {core}" in report and "set by the user" in report
