"""Machine notes that travel with every result: CPU, cores, load, BLAS, versions, commit."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess

from workers.bench.servers import REPO_ROOT


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def blas_notes() -> dict | str:
    try:
        from gmlx.platform.blas import describe_blas, ensure_fast_blas
    except ImportError:
        return "describe_blas() not available in this checkout"
    try:
        # describe_blas imports mlx: the fast BLAS must be in place first, or this process
        # (an in-process engine target, the model copies) runs on mlx's bundled one.
        ensure_fast_blas()
        return describe_blas()
    except Exception as exc:  # a diagnostic must not sink the benchmark
        return f"describe_blas() failed: {type(exc).__name__}: {exc}"


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}{'+dirty' if dirty else ''}" if head else None


def machine_notes() -> dict:
    import psutil

    return {
        "cpu_model": cpu_model(),
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average_1m_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mlx": _version("mlx"),
        "mlx_lm": _version("mlx-lm"),
        "blas": blas_notes(),
        "git_commit": git_commit(),
    }
