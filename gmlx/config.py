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
# `gmlx serve` and `gmlx-worker` draft with n-gram unless told otherwise: it needs no model, and
# adaptive depth gates it to plain decoding where its drafts do not pay (BENCHMARKS.md, session 10).
# EngineConfig's own default stays none: a library engine loads no drafter it was not asked for.
SERVE_DRAFTER = "ngram"

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


def _env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """One of choices, lower-cased; default when unset or blank; ValueError naming the setting otherwise."""
    raw = os.environ.get(name, "").strip().lower() or default
    if raw not in choices:
        raise ValueError(f"{name}={raw!r}: expected one of {', '.join(choices)}")
    return raw


def is_preempt_enabled() -> bool:
    return _env_flag("GMLX_MTP_PREEMPT", True)


def is_resume_enabled() -> bool:
    return _env_flag("GMLX_MTP_RESUME", True)


def is_adaptive_depth_enabled() -> bool:
    """GMLX_ADAPTIVE_DEPTH=0: every speculating row drafts the drafter's fixed k (an A/B switch)."""
    return _env_flag("GMLX_ADAPTIVE_DEPTH", True)


def is_draft_evidence_enabled() -> bool:
    """GMLX_DRAFT_EVIDENCE=0: a drafter's per-round evidence (the n-gram match size) does not set
    the round's depth; the rows' estimates alone do (an A/B switch)."""
    return _env_flag("GMLX_DRAFT_EVIDENCE", True)


def width_cap_override() -> int | None:
    """GMLX_MTP_WIDTH_CAP, re-read by the loops every round."""
    return _env_int("GMLX_MTP_WIDTH_CAP")


def resume_min_budget() -> int:
    value = _env_int("GMLX_RESUME_MIN_BUDGET")
    return 32 if value is None else value


def blas_lib_override() -> str | None:
    raw = os.environ.get("GMLX_BLAS_LIB")
    return raw.strip() if raw and raw.strip() else None


BLAS_CORE_MODES = ("auto", "measure", "off")


def blas_core_mode() -> str:
    """GMLX_BLAS_CORE: auto (default) picks the OpenBLAS core from cached timings, measure
    re-times the candidates, off leaves OpenBLAS's own detection."""
    return _env_choice("GMLX_BLAS_CORE", BLAS_CORE_MODES, "auto")


def user_blas_core() -> str | None:
    """OPENBLAS_CORETYPE as the user set it; None when unset or when it is gmlx's own
    choice inherited from a parent process (marked by GMLX_BLAS_CORE_CHOSEN)."""
    core = os.environ.get("OPENBLAS_CORETYPE", "").strip()
    if not core or core == os.environ.get("GMLX_BLAS_CORE_CHOSEN", "").strip():
        return None
    return core


def mark_blas_core_chosen(core: str) -> None:
    """Set the core for the OpenBLAS about to load, and mark it as gmlx's choice so child
    processes (workers, probes) inherit it without taking it for the user's."""
    os.environ["OPENBLAS_CORETYPE"] = core
    os.environ["GMLX_BLAS_CORE_CHOSEN"] = core


def cache_dir() -> Path:
    """GMLX_CACHE_DIR, else $XDG_CACHE_HOME/gmlx, else ~/.cache/gmlx: per-machine measurements."""
    raw = os.environ.get("GMLX_CACHE_DIR", "").strip()
    if raw:
        return Path(raw)
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(base) if base else Path.home() / ".cache") / "gmlx"


CALIBRATE_MODES = ("auto", "measure", "off")


def calibrate_mode() -> str:
    """GMLX_CALIBRATE: auto (default) uses the cached speculation cost table or measures it,
    measure re-measures, off skips it."""
    return _env_choice("GMLX_CALIBRATE", CALIBRATE_MODES, "auto")


def is_interposer_enabled() -> bool:
    return _env_flag("GMLX_SGEMV_INTERPOSER", True)


def is_cpu_fusion_enabled() -> bool:
    return _env_flag("GMLX_FUSE_CPU_OPS", True)


def is_input_major_enabled() -> bool:
    return _env_flag("GMLX_INPUT_MAJOR_WEIGHTS", True)


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def http_api_key() -> str | None:
    raw = os.environ.get("GMLX_HTTP_API_KEY")
    return raw.strip() if raw and raw.strip() else None


def is_cpu_kernels_enabled() -> bool:
    return _env_flag("GMLX_CPU_KERNELS", True)


def is_cpu_decode_ops_enabled() -> bool:
    """GMLX_CPU_DECODE_OPS (default on): with the CPU kernels on, also their RMSNorm, RoPE and
    attention; off keeps only the quantized products (for A/B runs)."""
    return _env_flag("GMLX_CPU_DECODE_OPS", True)


def is_fused_layers_enabled() -> bool:
    """GMLX_CPU_FUSED_LAYERS (default on): with the decode ops on, a llama or qwen3 layer whose products are
    all in the quad layout (or all float32 panels) runs as fused kernel nodes
    (gmlx/platform/cpu_layers.py, same bits); 0 keeps its ~20 (A/B runs)."""
    return _env_flag("GMLX_CPU_FUSED_LAYERS", True)


def is_one_node_layers_enabled() -> bool:
    """GMLX_CPU_ONE_NODE_LAYERS (default on): a fused layer is one node that writes the KV cache's
    buffers in place; 0 keeps it as six (attention_inputs, two KV writes, attention,
    project_add, mlp_block; same bits, for A/B runs)."""
    return _env_flag("GMLX_CPU_ONE_NODE_LAYERS", True)


def is_layer_stack_enabled() -> bool:
    """GMLX_CPU_LAYER_STACK (default on): where every layer of a model is a one-node fused layer of
    one shape, a step runs them all as one node that holds their weights; 0 keeps a node a
    layer (same bits, for A/B runs)."""
    return _env_flag("GMLX_CPU_LAYER_STACK", True)


def is_cpu_float_kernels_enabled() -> bool:
    """GMLX_CPU_FLOAT_KERNELS (default on): with the CPU kernels on, float32 linear weights are kept
    as panels and multiplied on the kernels' threads (gmlx/platform/cpu_float.py), and the decode
    ops and fused layers take float32 models too; 0 keeps the BLAS path, bit-identical to mlx-lm's."""
    return _env_flag("GMLX_CPU_FLOAT_KERNELS", True)


def is_quad_layout_enabled() -> bool:
    """GMLX_CPU_QUAD_LAYOUT (default on): int8-activation products with exact float16 scales keep
    their weights in the kernels' one-stream layout (same bits); 0 keeps mlx's rows (A/B runs)."""
    return _env_flag("GMLX_CPU_QUAD_LAYOUT", True)


def is_k_tile_layout_enabled() -> bool:
    """GMLX_CPU_K_TILES (default on): under the tile layout a GGUF's Q4_K matrices keep Q4_K's own
    scales (0.578 bytes a weight, not 0.625; exact d * sc, not float16-rounded), and on VNNI CPUs its
    Q5_K ones their 5-bit levels (0.70 bytes, not 1.125 at 8 bits), its Q6_K ones Q6_K's 6-bit levels
    and scales (0.82 bytes, not 1.125 at 8 bits; exact, not requantized), its Q3_K ones Q3_K's 3-bit
    levels and scales (0.45 bytes, exact) and its Q2_K ones Q2_K's 2-bit levels, scales and mins (0.33
    bytes, exact); 0 packs all from their triplets as before (A/B runs)."""
    return _env_flag("GMLX_CPU_K_TILES", True)


def is_five_bit_tiles_enabled() -> bool:
    """GMLX_CPU_FIVE_BIT_TILES (default on): under the tile layout on VNNI CPUs, 8-bit products whose
    levels all fit 5 bits (a GGUF's Q5_0 and Q5_1, read exactly at 8 bits) keep them at 5 bits (0.75
    bytes a weight, not 1.125; the same bits); 0 packs them at 8 (A/B runs)."""
    return _env_flag("GMLX_CPU_FIVE_BIT_TILES", True)


def is_iq4_tiles_enabled() -> bool:
    """GMLX_CPU_IQ4_TILES (default on): under the tile layout on VNNI CPUs, 8-bit products whose
    levels all are IQ4's 16 codebook values (a GGUF's IQ4_NL and IQ4_XS, read exactly at 8 bits) keep
    their 4-bit indices (0.625 bytes a weight, not 1.125; the same bits); 0 packs them at 8 (A/B runs)."""
    return _env_flag("GMLX_CPU_IQ4_TILES", True)


ROW_INVARIANCE_MODES = ("auto", "1", "0")


def row_invariance_mode() -> str:
    """GMLX_ROW_INVARIANCE: auto (default) makes every product run on a fixed row count and
    attention one query a call on a GPU, where a row's bits otherwise depend on the batch (measured
    on CUDA: gmlx/platform/row_invariance.py); 1 does it on the CPU too (tests, A/B); 0 never."""
    return _env_choice("GMLX_ROW_INVARIANCE", ROW_INVARIANCE_MODES, "auto")


def product_block_rows() -> int:
    """GMLX_PRODUCT_BLOCK_ROWS (default 32): the one row count every product runs on under row
    invariance; inputs are cut into blocks of this many rows, the last padded with zeros."""
    value = _env_int("GMLX_PRODUCT_BLOCK_ROWS")
    if value == 0:
        raise ValueError("GMLX_PRODUCT_BLOCK_ROWS=0: must be >= 1")
    return 32 if value is None else value


ROW_ATTENTION_RULES = ("masked", "unmasked")


def row_attention_rule() -> str:
    """GMLX_ROW_ATTENTION, attention's rule under row invariance: masked (default, validated on an
    H200) runs one query a call with an array mask; unmasked runs one row and one query a call
    with no mask over exactly the keys the query sees, the call a lone row's plain step makes."""
    return _env_choice("GMLX_ROW_ATTENTION", ROW_ATTENTION_RULES, "masked")


def cpu_tile_layout() -> bool | None:
    """GMLX_CPU_TILE_LAYOUT: 1 packs the one-stream layout as 16-output tiles, 0 as quads;
    unset, the kernels choose (tiles where the CPU has AVX-512 VNNI and runs it). Same bits."""
    raw = os.environ.get("GMLX_CPU_TILE_LAYOUT")
    return None if raw is None or raw.strip() == "" else _env_flag("GMLX_CPU_TILE_LAYOUT", True)


def cpu_amx() -> bool | None:
    """GMLX_CPU_AMX: 0 keeps the tiles' wide products (groups of 8-16 rows) on VNNI, 1 runs them on
    AMX where the CPU and the OS allow it; unset, the same (on where allowed). Same bits."""
    raw = os.environ.get("GMLX_CPU_AMX")
    return None if raw is None or raw.strip() == "" else _env_flag("GMLX_CPU_AMX", True)


def cpu_kernels_isa() -> str | None:
    raw = os.environ.get("GMLX_CPU_KERNELS_ISA")
    if raw is None or raw.strip() == "":
        return None
    value = raw.strip().lower()
    if value not in ("avx512", "avx2", "portable"):
        raise ValueError(f"GMLX_CPU_KERNELS_ISA={raw!r}: expected avx512, avx2 or portable")
    return value


CPU_QUANT_ACTIVATIONS = ("int8", "float")


def cpu_quant_activations() -> str:
    """GMLX_CPU_QUANT_ACTIVATIONS: what the CPU kernels' 4- and 8-bit products multiply the weights
    with. `int8` (default): each row of x quantized per 32 inputs to int8 (like llama.cpp's Q8
    activations) and integer dot products; other numerics than mlx, kept only where a load-time
    probe finds them close to dequantize + matmul. `float`: float32 x, mlx's numerics to the
    last bits. Default int8: ~1.3x less CPU per SmolLM2 step, greedy tokens off mlx-lm's only at
    near-ties and closer to llama.cpp's (BENCHMARKS.md, "int8 activations")."""
    raw = os.environ.get("GMLX_CPU_QUANT_ACTIVATIONS")
    value = (raw or "int8").strip().lower() or "int8"
    if value not in CPU_QUANT_ACTIVATIONS:
        raise ValueError(f"GMLX_CPU_QUANT_ACTIVATIONS={raw!r}: expected int8 or float")
    return value


def blas_threads() -> int:
    """GMLX_BLAS_THREADS: OpenBLAS's threads when OPENBLAS_NUM_THREADS is unset; 0 or unset =
    one fewer than the CPUs the process may use (at least 1). OpenBLAS's threaded sgemm
    stalls for up to seconds whenever another process takes one of its cores (measured on 2
    cores: 1.7 s steps against 30-60 ms single-threaded), and a server always shares the
    machine with its front-end and clients."""
    value = _env_int("GMLX_BLAS_THREADS")
    if value:
        return value
    num_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, num_cpus - 1)


def cpu_kernels_threads() -> int | None:
    """GMLX_CPU_KERNELS_THREADS; None (or 0) = every CPU the process may use."""
    return _env_int("GMLX_CPU_KERNELS_THREADS") or None


CPU_COMPUTE_FORMAT_SETTINGS = ("auto", "float32", "quantized")


def cpu_compute_format_setting() -> str:
    raw = (os.environ.get("GMLX_CPU_COMPUTE_FORMAT") or "auto").strip().lower()
    if raw not in CPU_COMPUTE_FORMAT_SETTINGS:
        raise ValueError(f"GMLX_CPU_COMPUTE_FORMAT={raw!r}: expected one of {', '.join(CPU_COMPUTE_FORMAT_SETTINGS)}")
    return raw


def is_malloc_tuned() -> bool:
    """GMLX_MALLOC_TUNE (default on): glibc serves KV-sized blocks from a heap it keeps
    (gmlx/platform/memory.py); 0 leaves malloc's defaults."""
    return _env_flag("GMLX_MALLOC_TUNE", True)


def is_huge_pages_enabled() -> bool:
    """GMLX_HUGE_PAGES (default on, Linux, CPU backend): the model's weights move onto 2 MB
    transparent huge pages at load, and the heap warmed for KV buffers faults in on them
    (gmlx/platform/memory.py); 0 leaves both on 4 KB pages (A/B runs)."""
    return _env_flag("GMLX_HUGE_PAGES", True)


def log_level() -> str:
    level = os.environ.get("GMLX_LOG_LEVEL", "INFO").strip().upper() or "INFO"
    if level not in _LOG_LEVELS:
        raise ValueError(f"GMLX_LOG_LEVEL={level!r}: expected one of {', '.join(_LOG_LEVELS)}")
    return level


KV_CACHE_DTYPES = ("auto", "model", "float16")


def kv_cache_dtype() -> str:
    """GMLX_KV_DTYPE: auto (default) stores keys and values as float16 where the model's products
    quantize their activations to int8 (the 4-bit CPU path, whose logits the halves move no
    further), in the type the model computes them in otherwise; model and float16 pin one.
    Halves are rounded once to nearest even on every path (llama.cpp's default cache type)."""
    return _env_choice("GMLX_KV_DTYPE", KV_CACHE_DTYPES, "auto")


def kv_cache_budget_mb() -> int | None:
    """GMLX_KV_CACHE_MB: the most KV cache the decode rows in flight may hold, in MiB (None:
    a share of the memory available at start, gmlx/cache/budget.py)."""
    value = _env_int("GMLX_KV_CACHE_MB")
    if value == 0:
        raise ValueError("GMLX_KV_CACHE_MB='0': must be > 0 (unset it for the default)")
    return value


# A row's KV is reserved this many tokens of growth ahead of what it holds (cache/budget.py).
DEFAULT_KV_RESERVE_TOKENS = 256


def kv_reserve_tokens() -> int:
    """GMLX_KV_RESERVE_TOKENS: the growth a decode row's KV is reserved ahead of its length;
    rows that grow past the budget are evicted, latest arrival first, and resume by
    re-prefill. 0 reserves every row's whole max_tokens at admission: none is ever evicted."""
    value = _env_int("GMLX_KV_RESERVE_TOKENS")
    return DEFAULT_KV_RESERVE_TOKENS if value is None else value


def is_drafter_quantized() -> bool:
    """GMLX_CPU_DRAFTER_QUANTIZED (default on): on the CPU, a quantized target's MTP head and
    draft-vocabulary products are quantized to the target's bits in its kernels
    (gmlx/platform/cpu_drafter_products.py); 0 keeps them float32 (A/B runs)."""
    return _env_flag("GMLX_CPU_DRAFTER_QUANTIZED", True)


PREFILL_PACKING_MODES = ("auto", "1", "0")


def prefill_packing() -> bool | None:
    """GMLX_PREFILL_PACKING: 1 runs prompt chunks inside the decode rows' forward (one pass over
    the weights for both), 0 in forwards of their own; auto (default) chooses by the model
    (spec/prefill_pacing.py). EngineConfig.is_prefill_packed, when set, wins."""
    mode = _env_choice("GMLX_PREFILL_PACKING", PREFILL_PACKING_MODES, "auto")
    return None if mode == "auto" else mode == "1"


def validate_settings() -> None:
    """Read every GMLX_* setting once, so a malformed one fails start-up (ValueError naming
    it) instead of the first round that reads it."""
    for read in (is_preempt_enabled, is_resume_enabled, width_cap_override, resume_min_budget, blas_lib_override,
                 is_interposer_enabled, is_cpu_fusion_enabled, is_input_major_enabled, log_level, blas_threads,
                 is_malloc_tuned, is_huge_pages_enabled, cpu_quant_activations, is_quad_layout_enabled,
                 is_fused_layers_enabled, row_invariance_mode, product_block_rows, row_attention_rule,
                 is_drafter_quantized, is_adaptive_depth_enabled, is_draft_evidence_enabled, cpu_amx,
                 kv_cache_dtype, kv_cache_budget_mb, kv_reserve_tokens, prefill_packing):
        read()


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model_path: str | None = None  # None = the built-in model
    drafter: str = "none"  # none | mtp | draft[:PATH] | ngram
    speculative_width_cap: int | None = None  # None = drafter default, 0 = uncapped, N
    num_draft_tokens: int | None = None  # None = the drafter's default depth
    max_num_rows: int = 64  # decode rows in flight; more requests queue
    prefill_chunk_tokens: int = 256  # most prompt tokens prefilled per step
    # Prefill time per step while rows decode, so an arrival stalls them a bounded time:
    # 0 = off (always prefill_chunk_tokens), None = from the measured decode round, x = x s.
    prefill_budget_s: float | None = 0.0
    # Chunks prefilled beside running rows ride their forward (one pass over the weights).
    # None = when the model's weights outweigh the packing's extra ops (engine.py), or force it.
    is_prefill_packed: bool | None = None
    prompt_cache_bytes: int = 256 << 20  # budget of the retired-prefix cache
    kv_cache_bytes: int | None = None  # rows in flight's KV budget; None = GMLX_KV_CACHE_MB, or a default
    num_memory_sharers: int = 1  # engines started together on this device: the default is 1/N each
    max_context_tokens: int | None = None  # None = the model's max_position_embeddings
    is_batch_draft_coupled: bool = True  # batch-loop drafters sample with each row's noise (False: greedy)
    is_adaptive_depth: bool = True  # each row drafts k in 0..num_draft_tokens from its live acceptance
    is_draft_evidence: bool = True  # with it, a drafter's per-round grades set each round's depth (depth.py)
    # Depths and the width cap weigh the start-up cost table by the rounds as served (False: the table alone).
    is_served_costs: bool = True
    is_stochastic_acceptance: bool = False  # accept drafts with min(1, p/q) (mtp, draft); False: exact match
