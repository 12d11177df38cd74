"""Chooses the OpenBLAS core before OpenBLAS loads: reads the CPU, times the candidate
cores in child processes (gmlx/platform/blas_probe.py), caches the timings per machine
and BLAS build, and sets OPENBLAS_CORETYPE. This module must not import mlx.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gmlx import config
from gmlx.platform import machine_cache
from gmlx.platform.blas_cores import CoreChoice, CoreTiming, candidate_cores, choose_core, is_x86, unrunnable_reason
from gmlx.platform.timing import OtherLoad

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 60.0
CACHE_VERSION = 2  # bumped when the candidate set changes (Zen joined)


@dataclass(slots=True)
class CoreSelection:
    """What the start-up choice saw and did (for `gmlx doctor`)."""

    detected: str | None = None  # the core OpenBLAS picks by itself here
    choice: CoreChoice | None = None
    timings: dict[str, CoreTiming] = field(default_factory=dict)
    is_cached: bool = False


@functools.cache
def _cpuinfo_fields() -> dict[str, str]:
    """The first value of each /proc/cpuinfo key, read once a process (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags ("flags" on x86, "Features" on arm64)."""
    fields = _cpuinfo_fields()
    return frozenset((fields.get("flags") or fields.get("Features") or "").split())


def cpu_model_name() -> str:
    return _cpuinfo_fields().get("model name") or platform.processor() or platform.machine()


CACHE_NAME = "blas_cores"


def _cache_key(blas_path: str, interposer_path: Path, flags: frozenset[str]) -> str:
    parts = [cpu_model_name(), " ".join(sorted(flags)), blas_path, str(os.cpu_count()),
             os.environ.get("OPENBLAS_NUM_THREADS", ""), str(CACHE_VERSION)]
    return machine_cache.cache_key(parts, [Path(blas_path), interposer_path])


def _read_cache(key: str) -> tuple[str | None, dict[str, CoreTiming]] | None:
    entry = machine_cache.read_entry(CACHE_NAME, key)
    try:
        return entry.get("detected"), {core: CoreTiming(**t) for core, t in entry["timings"].items()}
    except (AttributeError, KeyError, TypeError):
        return None


def _write_cache(key: str, detected: str | None, timings: dict[str, CoreTiming]) -> None:
    machine_cache.write_entry(CACHE_NAME, key, {"detected": detected, "cpu": cpu_model_name(),
                                                "timings": {core: asdict(t) for core, t in timings.items()}})


def probe_core(blas_path: str, core: str | None) -> CoreTiming | None:
    """Time one core in a child process (core None: OpenBLAS's own detection)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "GMLX_BLAS_CORE_CHOSEN")}
    env.update(GMLX_BLAS_CORE="off", GMLX_BLAS_LIB=blas_path)
    if core is not None:
        env["OPENBLAS_CORETYPE"] = core
    repo_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH")) if p)
    try:
        out = subprocess.run([sys.executable, "-m", "gmlx.platform.blas_probe"], env=env, capture_output=True,
                             text=True, timeout=PROBE_TIMEOUT_S, check=True)
        d = json.loads(out.stdout)
        return CoreTiming(core=d["core"], decode_ms=float(d["decode_ms"]), matmul_ms=float(d["matmul_ms"]),
                          is_routing=bool(d["is_routing"]))
    except (OSError, subprocess.SubprocessError, ValueError, KeyError) as exc:
        logger.info("BLAS core probe %s failed: %s", core or "(detected)", exc)
        return None


def measure_cores(blas_path: str, flags: frozenset[str]) -> tuple[str | None, dict[str, CoreTiming]]:
    """(the detected core, timings of every candidate core)."""
    detected_timing = probe_core(blas_path, None)
    if detected_timing is None:
        return None, {}
    detected = detected_timing.core
    timings = {detected: detected_timing}
    for core in candidate_cores(flags, detected):
        if core not in timings:
            timing = probe_core(blas_path, core)
            if timing is not None and timing.core == core:  # OpenBLAS may refuse a core
                timings[core] = timing
    return detected, timings


def _drop_unrunnable_user_core() -> str:
    """Unset a user's OPENBLAS_CORETYPE naming kernels this CPU cannot execute (the BLAS would
    die of an illegal instruction as it loads); what was dropped and why, or ""."""
    user_core = config.user_blas_core()
    if user_core is None or not is_x86(platform.machine()):
        return ""
    refusal = unrunnable_reason(user_core, cpu_flags())
    if refusal is None:
        return ""
    logger.warning("OPENBLAS_CORETYPE=%s ignored: %s", user_core, refusal)
    del os.environ["OPENBLAS_CORETYPE"]
    return f"OPENBLAS_CORETYPE={user_core} ignored ({refusal}); "


def select_core(blas_path: str, interposer_path: Path) -> CoreSelection:
    """Decide OPENBLAS_CORETYPE for the BLAS about to load, and set it. Never raises
    for a slow or failing probe: the fallback is OpenBLAS's own detection."""
    if not os.environ.get("OPENBLAS_CORETYPE", "x").strip():
        # Blank is unset to gmlx but set to OpenBLAS: on an AVX2 EPYC it then ran Haswell, not the Zen it detects.
        del os.environ["OPENBLAS_CORETYPE"]
    dropped = _drop_unrunnable_user_core()
    sel = _select_core(blas_path, interposer_path)
    if dropped:
        sel.choice = CoreChoice(sel.choice.core, dropped + sel.choice.reason)
    return sel


def _select_core(blas_path: str, interposer_path: Path) -> CoreSelection:
    sel = CoreSelection()
    machine, flags = platform.machine(), cpu_flags()
    user_core = config.user_blas_core()
    inherited = os.environ.get("GMLX_BLAS_CORE_CHOSEN", "").strip() or None
    mode = config.blas_core_mode()
    if user_core is not None or not is_x86(machine):
        sel.choice = choose_core(machine, flags, None, user_core, None)
        return sel
    if mode == "off":
        sel.choice = CoreChoice(None, "OpenBLAS's own detection (GMLX_BLAS_CORE=off)")
        return sel
    key = _cache_key(blas_path, interposer_path, flags)
    cached = _read_cache(key) if mode == "auto" else None
    if cached is not None:
        sel.detected, sel.timings = cached
        sel.is_cached = True
    elif inherited is None:  # a child of a gmlx process that chose already need not measure
        logger.info("timing the OpenBLAS cores this CPU can run (once per machine; cached in %s)",
                    machine_cache.cache_path(CACHE_NAME))
        with OtherLoad() as load:
            sel.detected, sel.timings = measure_cores(blas_path, flags)
        if sel.timings and not load.is_disturbed:
            _write_cache(key, sel.detected, sel.timings)
        elif sel.timings:  # chosen for this process; the next start times the cores again
            logger.warning("OpenBLAS core timings not cached: other processes used %.0f%% of the CPU meanwhile",
                           100 * load.share)
    if inherited is not None and not sel.timings:
        sel.choice = CoreChoice(inherited, f"{inherited}, chosen by the parent gmlx process")
    else:
        sel.choice = choose_core(machine, flags, sel.detected, None, sel.timings or None)
    if sel.choice.core is not None:
        config.mark_blas_core_chosen(sel.choice.core)
    return sel
