"""Decode speed across values of one of the CPU kernels' same-bits settings, side by side in one
process.

The settings here change how the kernels run, never what they compute (tests/test_cpu_kernels.py
checks each for bits), and take effect on the next product, so one loaded engine serves every
value: scripts/ab.py's ABBA turns, the median of per-rep ratios to the first value. What each
turn times is greedy width-1 decode (--tokens) of SmolLM2 in the chosen compute format.

    python3 scripts/bench_kernel_settings.py prefetch_chunks 0,2,4,8,16 --reps 6
    python3 scripts/bench_kernel_settings.py min_pool_macs 262144,65536,600000 --reps 6
    python3 scripts/bench_kernel_settings.py num_threads 2,1 --format float32
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this tree's gmlx
sys.path.insert(0, str(ROOT / "scripts"))

from bench_compute_format import gmlx_tok_per_s  # noqa: E402  (sets the BLAS up before mlx)

from ab import alternate, median_ratio  # noqa: E402
from gmlx.config import EngineConfig, env_overrides  # noqa: E402
from gmlx.engine import Engine  # noqa: E402
from gmlx.models.source import resolve_model_path  # noqa: E402
from gmlx.platform import cpu_kernels  # noqa: E402

# Setting -> the extension's setter; each is checked for bits across its values in the tests.
SETTERS = {
    "prefetch_chunks": "set_prefetch_chunks",  # one-stream kernels' software prefetch distance
    "min_pool_macs": "set_min_pool_macs",  # smallest product handed to the pool
    "num_threads": "set_num_threads",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("setting", choices=sorted(SETTERS))
    parser.add_argument("values", help="comma-separated integers; ratios are to the first")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--format", default="quantized", help="GMLX_CPU_COMPUTE_FORMAT (quantized, float32)")
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    try:
        values = [int(v) for v in args.values.split(",")]
    except ValueError:
        parser.error(f"values {args.values!r}: expected comma-separated integers")
    if len(values) < 2:
        parser.error(f"values {args.values!r}: need at least two to compare")
    if not cpu_kernels.is_available():
        sys.exit("gmlx's CPU kernels are not built or not switched on here")
    with env_overrides({"GMLX_CPU_COMPUTE_FORMAT": args.format}):
        engine = Engine.load(EngineConfig(model_path=str(resolve_model_path(args.model)), prompt_cache_bytes=0))
    setter = getattr(cpu_kernels.extension(), SETTERS[args.setting])
    gmlx_tok_per_s(engine, 32)  # warm: first-use allocations and the KV heap

    def run(mode: str) -> float:
        setter(int(mode))
        return statistics.median(gmlx_tok_per_s(engine, args.tokens) for _ in range(2))

    runs = alternate([str(v) for v in values], args.reps, run)
    setter(-1)  # back to the default (every setter here reads < 0 as "default")
    print(f"{platform.machine()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {args.model} {args.format}, "
          f"{args.reps} ABBA reps, {args.tokens} tokens, each turn the median of 2 decodes")
    base = str(values[0])
    print(f"| {args.setting} | tok/s (median) | x {base} (median of per-rep ratios) | per rep |")
    print("|---|---|---|---|")
    for mode, rates in runs.items():
        ratios = [a / b for a, b in zip(rates, runs[base])]
        print(f"| {mode} | {statistics.median(rates):.1f} | {median_ratio(zip(rates, runs[base])):.3f} | "
              f"{', '.join(f'{r:.2f}' for r in ratios)} |")


if __name__ == "__main__":
    main()
