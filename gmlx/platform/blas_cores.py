"""Which OpenBLAS kernel set ("core") to run on this CPU: a small pure function.

Debian's OpenBLAS 0.3.21 picks its kernels from the CPU model. On CPUs newer than the
build it falls back (Intel Emerald Rapids gets Prescott's SSE3 kernels, ~7x slower at
matmul), and on AVX-512 CPUs it picks kernels whose summation order the interposer does
not reproduce, so decode's few-row products lose the interposer's ~2x. The choice is
between the fastest sgemm kernels (interposer passing through) and the Haswell kernels
(interposer routing), made from timings of a decode-shaped sequence of products
(gmlx/platform/blas_probe.py); this module only ranks what was measured.
This module must not import mlx.
"""

from __future__ import annotations

from dataclasses import dataclass

# OpenBLAS x86-64 cores, oldest first, with the /proc/cpuinfo flags their kernels need.
_SKYLAKEX_FLAGS = frozenset({"avx2", "fma", "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})
X86_CORE_FLAGS: dict[str, frozenset[str]] = {
    "Prescott": frozenset({"pni"}),  # SSE3 ("pni" in /proc/cpuinfo)
    "Nehalem": frozenset({"pni", "ssse3", "sse4_2"}),
    "Sandybridge": frozenset({"avx"}),
    "Haswell": frozenset({"avx2", "fma"}),
    "Zen": frozenset({"avx2", "fma"}),
    "SkylakeX": _SKYLAKEX_FLAGS,
    "Cooperlake": _SKYLAKEX_FLAGS | {"avx512_bf16"},
    "SapphireRapids": _SKYLAKEX_FLAGS | {"avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16"},
}
_X86_RANK = {"Prescott": 0, "Nehalem": 1, "Sandybridge": 2, "Haswell": 3, "Zen": 3, "SkylakeX": 4,
             "Cooperlake": 5, "SapphireRapids": 6}
# Cores whose sgemm summation order the interposer's calibration reproduces.
INTERPOSER_CORES = ("Haswell", "Zen")
# Timings within this fraction of the fastest decode count as a tie, broken by matmul time.
DECODE_TIE_FRACTION = 0.03


@dataclass(frozen=True, slots=True)
class CoreTiming:
    """One core's measurement (blas_probe): a decode-shaped product sequence and a matmul."""

    core: str  # the name OpenBLAS reported for the kernels it ran
    decode_ms: float  # one pass of few-row products over a ~45 MB layer, best layout
    matmul_ms: float  # (1024, 1024) @ (1024, 1024), prefill-shaped
    is_routing: bool  # the interposer routed the few-row products


@dataclass(frozen=True, slots=True)
class CoreChoice:
    core: str | None  # the OPENBLAS_CORETYPE to set; None leaves OpenBLAS's own detection
    reason: str


def is_x86(machine: str) -> bool:
    return machine.lower() in ("x86_64", "amd64", "i686", "i386")


def executable_cores(flags: frozenset[str]) -> list[str]:
    """The x86-64 OpenBLAS cores this CPU can run, oldest first."""
    return [core for core, needed in X86_CORE_FLAGS.items() if needed <= flags]


def unrunnable_reason(core: str, flags: frozenset[str]) -> str | None:
    """Why this CPU cannot execute a known x86-64 core's kernels (the flags it lacks), or None:
    OpenBLAS 0.3.21 forced onto SkylakeX without AVX-512 dies of an illegal instruction."""
    missing = X86_CORE_FLAGS.get(core, frozenset()) - flags
    if not missing:
        return None
    return f"this CPU cannot execute OpenBLAS's {core} kernels (no {', '.join(sorted(missing))})"


def best_core(flags: frozenset[str]) -> str | None:
    """The newest core the CPU can run (Zen and Haswell rank alike; Haswell is named)."""
    cores = [c for c in executable_cores(flags) if c != "Zen"]
    return max(cores, key=_X86_RANK.__getitem__) if cores else None


def is_fallback(detected: str, flags: frozenset[str]) -> bool:
    """Whether OpenBLAS picked an older core than the CPU can run (it did not know the CPU)."""
    best = best_core(flags)
    if best is None or detected not in _X86_RANK:
        return False
    return _X86_RANK[detected] < _X86_RANK[best]


def candidate_cores(flags: frozenset[str], detected: str | None) -> list[str]:
    """What to measure: the detected core, the interposer's cores (Haswell and Zen: same
    order, other blocking), every AVX-512 core the CPU runs (an older OpenBLAS may not know
    the newest, so each is tried)."""
    cores = [detected] if detected else []
    runnable = executable_cores(flags)
    for core in (*INTERPOSER_CORES, *[c for c in runnable if _X86_RANK[c] > _X86_RANK["Haswell"]]):
        if core in runnable and core not in cores:
            cores.append(core)
    return cores


def choose_core(machine: str, flags: frozenset[str], detected: str | None, user_core: str | None,
                timings: dict[str, CoreTiming] | None) -> CoreChoice:
    """The core to force, from (CPU, OpenBLAS's own pick, the user's setting, timings).

    `timings` maps each candidate core to its measurement, None when it was not measured.
    """
    if user_core:
        return CoreChoice(user_core, f"OPENBLAS_CORETYPE={user_core} set by the user")
    if not is_x86(machine):
        return CoreChoice(None, f"OpenBLAS's own detection ({machine}: no core choice is made there)")
    fell_back = detected is not None and is_fallback(detected, flags)
    if not timings:
        best = best_core(flags)
        if fell_back and best is not None:
            return CoreChoice(best, f"OpenBLAS fell back to {detected} on a CPU that runs {best}; "
                                    f"forcing {best} (not measured)")
        return CoreChoice(None, f"OpenBLAS's own detection ({detected}; not measured)")
    fastest = min(t.decode_ms for t in timings.values())
    ties = [c for c, t in timings.items() if t.decode_ms <= fastest * (1 + DECODE_TIE_FRACTION)]
    chosen = min(ties, key=lambda c: (timings[c].matmul_ms, c != detected))
    t = timings[chosen]
    how = (f"{chosen}: decode products {t.decode_ms:.2f} ms, matmul {t.matmul_ms:.1f} ms, "
           f"interposer {'routing' if t.is_routing else 'passing through'}")
    others = "; ".join(f"{c} {timings[c].decode_ms:.2f}/{timings[c].matmul_ms:.1f} ms"
                       for c in timings if c != chosen)
    if others:
        how += f" (against {others})"
    if chosen == detected:
        return CoreChoice(None, f"kept OpenBLAS's {detected}, fastest measured: {how}")
    prefix = f"OpenBLAS fell back to {detected}; " if fell_back else f"OpenBLAS picked {detected}; "
    return CoreChoice(chosen, prefix + f"forcing the fastest measured, {how}")
