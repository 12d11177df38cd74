"""`gmlx doctor`: what this machine runs gmlx with, in words: the CPU, the BLAS and the
core OpenBLAS runs (detected, chosen, why, measured), the interposer, the MLX device, the
CPU kernel extension, transparent huge pages and row invariance.
This module must not import mlx at import time.
"""

from __future__ import annotations

import platform

from gmlx.platform.blas import INSTALL_HINT, MAX_ROUTED_ROWS, describe_blas
from gmlx.platform.blas_select import cpu_flags, cpu_model_name

# Vector extensions worth naming, as /proc/cpuinfo spells them.
_NAMED_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "asimd", "sve", "sve2")


def describe_platform(measure: bool = True) -> dict:
    """describe_blas() plus the CPU and the MLX device (imports mlx: the BLAS must be loaded)."""
    d = describe_blas(measure=measure)
    flags = cpu_flags()
    d["cpu"] = {"model": cpu_model_name(), "machine": platform.machine(),
                "features": [f for f in _NAMED_FLAGS if f in flags]}
    import mlx.core as mx

    d["mlx_device"] = str(mx.default_device())
    from gmlx.platform import cpu_kernels

    d["cpu_kernels"] = cpu_kernels.status()
    from gmlx.models.compute_format import choose_cpu_compute_format

    d["cpu_compute_format"], d["cpu_compute_format_reason"] = choose_cpu_compute_format()
    from gmlx.platform.memory import huge_pages_status

    d["huge_pages"] = huge_pages_status()
    from gmlx.platform.row_invariance import describe_row_invariance

    d["row_invariance"] = describe_row_invariance()
    return d


def format_report(d: dict) -> str:
    cpu = d["cpu"]
    lines = [f"CPU: {cpu['model']} ({cpu['machine']}; {', '.join(cpu['features']) or 'no vector extensions named'})",
             f"MLX device: {d['mlx_device']}"]
    from gmlx.platform import cpu_kernels

    return "\n".join(lines + [format_blas_report(d), cpu_kernels.format_status(d["cpu_kernels"]),
                              f"quantized models on CPU compute in: {d['cpu_compute_format']} "
                              f"({d['cpu_compute_format_reason']})",
                              f"transparent huge pages: {d['huge_pages']}",
                              f"row invariance: {d['row_invariance']}"])


def format_blas_report(d: dict) -> str:
    """Human-readable lines for `gmlx doctor`."""
    if not d["platform"].startswith("linux"):
        lines = [f"BLAS: the platform's own ({d['platform']}: Accelerate on macOS); nothing to load"]
    elif d["library"] is None:
        if d["requested_library"]:
            why = f"could not load {d['requested_library']}"
        else:
            why = "GMLX_BLAS_LIB=none" if d["source"] else f"none found; install: {INSTALL_HINT}"
        lines = [f"BLAS: mlx's bundled reference BLAS ({why})"]
    else:
        lines = [f"BLAS: {d['library']} (found by {d['source']})"]
        if "openblas_version" in d:
            lines.append(
                f"  OpenBLAS {d['openblas_version']}, core {d.get('openblas_corename')}, "
                f"{d.get('num_threads')} threads  [{d.get('openblas_config')}]"
            )
    if "core_reason" in d:
        chosen = d["core_chosen"] or f"none forced (running {d.get('openblas_corename')})"
        lines.append(f"  core: detected {d['core_detected'] or 'unknown'}, chosen {chosen}: {d['core_reason']}")
        if d["core_timings"]:
            cached = " (cached; GMLX_BLAS_CORE=measure re-times)" if d["core_timings_cached"] else ""
            lines.append("  core timings" + cached + ": " + "; ".join(
                f"{c} decode {t['decode_ms']:.2f} ms, matmul {t['matmul_ms']:.1f} ms, "
                f"{'routing' if t['is_routing'] else 'pass-through'}" for c, t in d["core_timings"].items()))
    if "matmul_1024_ms" in d:
        lines.append(f"  1024x1024 fp32 matmul: {d['matmul_1024_ms']:.1f} ms (reference BLAS: ~400-600 ms)")
    state = "active" if d["is_interposer_active"] else d["interposer_status"]
    lines.append(f"few-row sgemm interposer: {state}; {d['num_routed']} calls routed, {d['num_passed']} passed to sgemm")
    if d.get("routed_layouts"):
        blk = d["blocking"]
        lines.append(f"  routes: {', '.join(d['routed_layouts'])} (one-row products, bit-identical to sgemm)")
        for driver, by_rows in d["routed_rows"].items():
            if by_rows:
                orders = ", ".join(f"{m}:{o}" for m, o in by_rows.items())
                lines.append(f"  routes x@W.T of 2-{MAX_ROUTED_ROWS} rows, {driver} sgemm driver: {orders}")
        for driver, row_counts in d["routed_rows_input_major"].items():
            if row_counts:
                lines.append(f"  routes x@W (input-major weights) of {', '.join(map(str, row_counts))} rows, "
                             f"{driver} sgemm driver")
        lines.append(
            f"  reproduces sgemm's K blocking: GEMM_Q={blk['gemm_q']}, unroll {blk['unroll']}, "
            f"threaded above M*N*K={blk['threaded_above_mnk']}, alpha {blk['alpha_mode']}"
        )
    if "one_row_4096_plain_ms" in d:
        plain, routed = d["one_row_4096_plain_ms"], d["one_row_4096_ms"]
        lines.append(
            f"  (1, 4096) @ (4096, 4096).T: {routed:.2f} ms routed vs {plain:.2f} ms plain sgemm "
            f"({plain / routed:.2f}x)"
        )
        plain4, routed4 = d["four_rows_4096_plain_ms"], d["four_rows_4096_ms"]
        lines.append(
            f"  (4, 4096) @ (4096, 4096).T: {routed4:.2f} ms routed vs {plain4:.2f} ms plain sgemm "
            f"({plain4 / routed4:.2f}x)"
        )
    elif d["is_interposer_active"] and "is_routing_effective" in d:
        lines.append("  WARNING: mlx's matmuls did not reach the interposer (was mlx imported before ensure_fast_blas()?)")
    if d["is_mlx_imported_first"]:
        lines.append("WARNING: mlx was imported before gmlx loaded the fast BLAS; call "
                     "gmlx.platform.blas.ensure_fast_blas() first")
    lines += [f"note: {note}" for note in d["notes"]]
    return "\n".join(lines)
