"""The OpenBLAS core chooser: a pure function of (CPU flags, detected core, user setting,
timings), checked for the CPUs gmlx has met (AMD Zen 2-4, Intel Skylake-X to Emerald Rapids)."""

import pytest

from gmlx.platform.blas_cores import (CoreTiming, best_core, candidate_cores, choose_core, executable_cores,
                                      is_fallback, unrunnable_reason)

BASE = frozenset({"pni", "ssse3", "sse4_2", "avx"})
ZEN2 = BASE | {"avx2", "fma"}  # no AVX-512
ZEN4 = ZEN2 | {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16"}
SKYLAKEX = ZEN2 | {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}
EMERALD_RAPIDS = ZEN4 | {"avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"}
SSE_ONLY = frozenset({"pni", "ssse3"})


def timing(core, decode_ms, matmul_ms, is_routing=False):
    return CoreTiming(core=core, decode_ms=decode_ms, matmul_ms=matmul_ms, is_routing=is_routing)


@pytest.mark.parametrize("flags, best", [(SSE_ONLY, "Prescott"), (ZEN2, "Haswell"), (SKYLAKEX, "SkylakeX"),
                                         (ZEN4, "Cooperlake"), (EMERALD_RAPIDS, "SapphireRapids")])
def test_best_core_is_the_newest_the_cpu_runs(flags, best):
    assert best_core(flags) == best
    assert best in executable_cores(flags)


def test_avx512_cores_need_every_avx512_flag():
    assert "SkylakeX" not in executable_cores(ZEN2 | {"avx512f"})
    assert "Cooperlake" not in executable_cores(SKYLAKEX)
    assert "SapphireRapids" not in executable_cores(ZEN4)


def test_a_core_the_cpu_cannot_execute_is_named_with_the_flags_it_lacks():
    assert unrunnable_reason("SkylakeX", ZEN2) == ("this CPU cannot execute OpenBLAS's SkylakeX kernels "
                                                   "(no avx512bw, avx512cd, avx512dq, avx512f, avx512vl)")
    assert unrunnable_reason("Cooperlake", SKYLAKEX).endswith("(no avx512_bf16)")
    assert unrunnable_reason("SkylakeX", SKYLAKEX) is None and unrunnable_reason("Haswell", ZEN2) is None
    assert unrunnable_reason("NotACore", SSE_ONLY) is None  # unknown names are OpenBLAS's to judge


@pytest.mark.parametrize("flags, detected, expected", [
    (EMERALD_RAPIDS, "Prescott", True),  # OpenBLAS 0.3.21 does not know model 207
    (ZEN4, "Cooperlake", False),
    (ZEN4, "Zen", True),
    (ZEN2, "Zen", False),
    (ZEN2, "Haswell", False),
    (SKYLAKEX, "SkylakeX", False),
    (SKYLAKEX, "Haswell", True),
    (SSE_ONLY, "Prescott", False),
    (ZEN2, "NotACore", False),
])
def test_is_fallback(flags, detected, expected):
    assert is_fallback(detected, flags) is expected


def test_candidates_cover_detected_interposer_and_avx512_cores():
    assert candidate_cores(EMERALD_RAPIDS, "Prescott") == ["Prescott", "Haswell", "Zen", "SkylakeX", "Cooperlake",
                                                           "SapphireRapids"]
    assert candidate_cores(ZEN4, "Cooperlake") == ["Cooperlake", "Haswell", "Zen", "SkylakeX"]
    assert candidate_cores(ZEN2, "Zen") == ["Zen", "Haswell"]
    assert candidate_cores(SSE_ONLY, "Prescott") == ["Prescott"]


def test_user_setting_always_wins():
    timings = {"Haswell": timing("Haswell", 1.0, 10.0, True)}
    choice = choose_core("x86_64", ZEN4, "Cooperlake", "SkylakeX", timings)
    assert choice.core == "SkylakeX" and "set by the user" in choice.reason


def test_non_x86_keeps_openblas_detection():
    choice = choose_core("aarch64", frozenset({"asimd", "sve"}), "NeoverseV1", None, None)
    assert choice.core is None and "aarch64" in choice.reason


def test_emerald_rapids_unmeasured_forces_the_best_core():
    choice = choose_core("x86_64", EMERALD_RAPIDS, "Prescott", None, None)
    assert choice.core == "SapphireRapids" and "fell back to Prescott" in choice.reason


def test_unmeasured_non_fallback_keeps_detection():
    assert choose_core("x86_64", ZEN4, "Cooperlake", None, None).core is None


def test_emerald_rapids_measured_picks_the_fastest_decode():
    # The machine: Prescott 183 ms matmul, Haswell 54 with the interposer, SkylakeX 25.
    timings = {"Prescott": timing("Prescott", 60.0, 183.0), "Haswell": timing("Haswell", 21.0, 54.0, True),
               "SkylakeX": timing("SkylakeX", 35.0, 25.0), "Cooperlake": timing("Cooperlake", 36.0, 27.0)}
    choice = choose_core("x86_64", EMERALD_RAPIDS, "Prescott", None, timings)
    assert choice.core == "Haswell"
    assert "fell back to Prescott" in choice.reason and "routing" in choice.reason


def test_zen4_measured_forces_haswell_over_detected_cooperlake():
    timings = {"Cooperlake": timing("Cooperlake", 37.9, 39.8), "Haswell": timing("Haswell", 21.2, 40.0, True)}
    choice = choose_core("x86_64", ZEN4, "Cooperlake", None, timings)
    assert choice.core == "Haswell" and "picked Cooperlake" in choice.reason


def test_decode_tie_goes_to_the_faster_matmul():
    timings = {"Haswell": timing("Haswell", 20.0, 54.0, True), "SkylakeX": timing("SkylakeX", 20.4, 25.0)}
    assert choose_core("x86_64", SKYLAKEX, "SkylakeX", None, timings).core is None  # detected kept
    timings["SkylakeX"] = timing("SkylakeX", 23.0, 25.0)  # 15% slower decode: not a tie
    assert choose_core("x86_64", SKYLAKEX, "SkylakeX", None, timings).core == "Haswell"


def test_detected_core_kept_when_fastest():
    timings = {"Zen": timing("Zen", 20.0, 20.0, True), "Haswell": timing("Haswell", 25.0, 11.0, True)}
    choice = choose_core("x86_64", ZEN2, "Zen", None, timings)
    assert choice.core is None and "kept OpenBLAS's Zen" in choice.reason
