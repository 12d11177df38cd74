"""Engine configuration and every GMLX_* environment variable, read in one place.

This module must not import mlx: the BLAS loader reads it before mlx is imported.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

BUILTIN_DIR = Path(__file__).resolve().parent / "models" / "builtin"
BUILTIN_TARGET_DIR = BUILTIN_DIR / "target"
BUILTIN_DRAFT_DIR = BUILTIN_DIR / "draft"
BUILTIN_MTP_DIR = BUILTIN_DIR / "mtp"

# name -> what it does; the README's table is generated from the same words.
ENV_VARS = {
    "GMLX_MTP_PREEMPT": "1 (default) preempts a lone speculating stream when others wait; 0 makes them wait",
    "GMLX_MTP_RESUME": "1 (default) re-arms a gated batch once it drains within the cap; 0 latches the gate",
    "GMLX_MTP_WIDTH_CAP": "overrides every model's speculative_width_cap (0 = uncapped, N = speculate while <= N rows)",
    "GMLX_RESUME_MIN_BUDGET": "rows with fewer tokens left than this do not trigger a resume (default 32)",
    "GMLX_BLAS_LIB": "path of the BLAS shared library to load before mlx ('none' skips loading one)",
    "GMLX_SGEMV_INTERPOSER": "1 (default) routes one-row sgemm calls and x @ W.T or x @ W calls of 2-8 rows to the interposer's streaming kernels (bit-identical to sgemm) on Linux; 0 turns it off",
    "GMLX_FUSE_CPU_OPS": "1 (default) compiles a model's RMSNorm and RoPE on the CPU backend (fewer graph nodes per step, bit-identical results); 0 leaves them as mlx-lm builds them",
    "GMLX_INPUT_MAJOR_WEIGHTS": "1 (default) stores a model's Linear weights input-major on the CPU backend when the interposer routes that layout (its one-row kernel reads them front to back; results checked bit-identical at load); 0 keeps mlx-lm's layout",
    "GMLX_CPU_COMPUTE_FORMAT": "auto (default) | float32 | quantized: what a quantized model (a 4-bit GGUF) computes in on the CPU backend; auto picks the faster one measured here (float32 unless fast quantized CPU kernels are active)",
    "GMLX_LOG_LEVEL": "logging level for the CLI and daemons (default INFO)",
}


@contextlib.contextmanager
def env_overrides(values: dict[str, str]):
    """Set GMLX_* knobs for the duration of a block (A/B runs of an in-process engine)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r}: expected 0 or 1")


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected an integer") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r}: must be >= 0")
    return value


def is_preempt_enabled() -> bool:
    return _env_flag("GMLX_MTP_PREEMPT", True)


def is_resume_enabled() -> bool:
    return _env_flag("GMLX_MTP_RESUME", True)


def width_cap_override() -> int | None:
    """GMLX_MTP_WIDTH_CAP, re-read by the loops every round."""
    return _env_int("GMLX_MTP_WIDTH_CAP")


def resume_min_budget() -> int:
    value = _env_int("GMLX_RESUME_MIN_BUDGET")
    return 32 if value is None else value


def blas_lib_override() -> str | None:
    raw = os.environ.get("GMLX_BLAS_LIB")
    return raw.strip() if raw and raw.strip() else None


def is_interposer_enabled() -> bool:
    return _env_flag("GMLX_SGEMV_INTERPOSER", True)


def is_cpu_fusion_enabled() -> bool:
    return _env_flag("GMLX_FUSE_CPU_OPS", True)


def is_input_major_enabled() -> bool:
    return _env_flag("GMLX_INPUT_MAJOR_WEIGHTS", True)


CPU_COMPUTE_FORMAT_SETTINGS = ("auto", "float32", "quantized")


def cpu_compute_format_setting() -> str:
    raw = (os.environ.get("GMLX_CPU_COMPUTE_FORMAT") or "auto").strip().lower()
    if raw not in CPU_COMPUTE_FORMAT_SETTINGS:
        raise ValueError(f"GMLX_CPU_COMPUTE_FORMAT={raw!r}: expected one of {', '.join(CPU_COMPUTE_FORMAT_SETTINGS)}")
    return raw


def log_level() -> str:
    return os.environ.get("GMLX_LOG_LEVEL", "INFO").upper()


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model_path: str | None = None  # None = the built-in model
    drafter: str = "none"  # none | mtp | draft[:PATH] | ngram
    speculative_width_cap: int | None = None  # None = drafter default, 0 = uncapped, N
    num_draft_tokens: int | None = None  # None = the drafter's default depth
    max_num_rows: int = 64  # decode rows in flight; more requests queue
    prefill_chunk_tokens: int = 256  # tokens of one prompt prefilled per step
    prompt_cache_bytes: int = 256 << 20  # budget of the retired-prefix cache
    max_context_tokens: int | None = None  # None = the model's max_position_embeddings
    is_batch_draft_coupled: bool = True  # batch-loop drafters sample with each row's noise (False: greedy)
