"""The int8 path's two one-stream layouts side by side: 16-output tiles against quads.

Both give the same bits; the setting is process-wide and read when weights are packed and
when they are multiplied, so one process packs each layout under its own setting and flips
the setting before each timed run (scripts/ab.py's ABBA turns, medians of per-rep ratios).

  calls  per product: SmolLM2's shapes at 1-8 rows, --copies weights per shape (8: in
         cache; 160: from DRAM), ms a call
  model  SmolLM2 4-bit loaded twice: decode tok/s (64 tokens) and a forward of 1, 2, 3, 4, 8
         and 16 positions at 160 KV tokens (best of 10), tiles' speed over quads

    PYTHONPATH=. python3 scripts/bench_layouts.py --sections calls --copies 8
    PYTHONPATH=. python3 scripts/bench_layouts.py --sections model --reps 20
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

import bench_decode_ops  # noqa: E402  (sets the BLAS up before mlx)
import mlx.core as mx  # noqa: E402

from ab import alternate, median_ratio  # noqa: E402
from bench_compute_format import gmlx_tok_per_s  # noqa: E402
from gmlx.config import EngineConfig, env_overrides  # noqa: E402
from gmlx.engine import Engine  # noqa: E402
from gmlx.models.source import resolve_model_path  # noqa: E402
from gmlx.platform import cpu_kernels  # noqa: E402
from gmlx.platform.timing import best_of_s  # noqa: E402

LAYOUTS = ("tiles", "quads")
# SmolLM2-135M's products: q/o, k/v, gate+up grouped, down, the 8-bit tied head.
SHAPES = ((576, 576, 4), (192, 576, 4), (3072, 576, 4), (576, 1536, 4), (49152, 576, 8))
ROWS = (1, 2, 4, 8)
POSITIONS = (1, 2, 3, 4, 8, 16)


def use(layout: str) -> None:
    cpu_kernels.extension().set_tile_layout(layout == "tiles")


def packed_copies(num_outputs: int, num_inputs: int, bits: int, num_copies: int) -> dict[str, list]:
    """num_copies random weights of one shape in each layout (fewer of the head: 28 MB each)."""
    copies = {}
    for layout in LAYOUTS:
        use(layout)
        packed = []
        for seed in range(num_copies if num_outputs < 40_000 else 2):
            w, scales, biases = mx.quantize(mx.random.normal((num_outputs, num_inputs), key=mx.random.key(seed)),
                                            group_size=32, bits=bits)
            packed.append(cpu_kernels.pack_quads(w, scales.astype(mx.float16), biases.astype(mx.float16), 32, bits))
        mx.eval(packed)
        copies[layout] = packed
    return copies


def bench_calls(num_copies: int, num_reps: int) -> None:
    print(f"| shape (bits) | rows | tiles ms | quads ms | tiles' speed |  ({num_copies} copies a shape)")
    print("|---|---|---|---|---|")
    for num_outputs, num_inputs, bits in SHAPES:
        copies = packed_copies(num_outputs, num_inputs, bits, num_copies)
        for num_rows in ROWS:
            x = mx.random.normal((num_rows, num_inputs))
            mx.eval(x)

            def run(layout: str) -> float:
                use(layout)
                packed = copies[layout]
                calls = lambda: mx.eval([cpu_kernels.quantized_matmul_quads(x, p, num_outputs, bits) for p in packed])  # noqa: E731
                return best_of_s(calls, 3) / len(packed) * 1e3

            runs = alternate(LAYOUTS, num_reps, run)
            speed = median_ratio(zip(runs["quads"], runs["tiles"]))
            print(f"| {num_outputs}x{num_inputs} ({bits}) | {num_rows} | {statistics.median(runs['tiles']):.4f} | "
                  f"{statistics.median(runs['quads']):.4f} | {speed:.2f}x |")


def bench_model(num_reps: int) -> None:
    engines, forwards = {}, {}
    for layout in LAYOUTS:
        use(layout)
        with env_overrides({"GMLX_CPU_COMPUTE_FORMAT": "quantized"}):
            engine = Engine.load(EngineConfig(model_path=str(resolve_model_path("smollm2")), prompt_cache_bytes=0))
        engines[layout] = engine
        forwards[layout] = bench_decode_ops.verify_forwards(engine.target, POSITIONS)

    def run(layout: str) -> dict[str, float]:
        use(layout)
        times = {f"forward {n} ms": 1e3 * best_of_s(fn, 10) for n, fn in forwards[layout].items()}
        return {"decode tok/s": gmlx_tok_per_s(engines[layout], 64), **times}

    runs = alternate(LAYOUTS, num_reps, run)
    print(f"SmolLM2 4-bit, {num_reps} ABBA reps; tiles' speed is the median of per-rep ratios")
    print("| measure | tiles | quads | tiles' speed |")
    print("|---|---|---|---|")
    for key in runs["tiles"][0]:
        tiles, quads = ([r[key] for r in runs[layout]] for layout in LAYOUTS)
        faster = zip(tiles, quads) if key.endswith("tok/s") else zip(quads, tiles)
        print(f"| {key} | {statistics.median(tiles):.2f} | {statistics.median(quads):.2f} | {median_ratio(faster):.3f}x |")
    for layout in LAYOUTS:
        one = statistics.median(r["forward 1 ms"] for r in runs[layout])
        over = " / ".join(f"{statistics.median(r[f'forward {n} ms'] for r in runs[layout]) / one:.2f}" for n in POSITIONS[1:])
        print(f"{layout}: {'/'.join(map(str, POSITIONS[1:]))} positions over 1: {over}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="calls,model")
    parser.add_argument("--copies", type=int, default=8, help="calls: weights a shape (8 stay in cache, 160 do not)")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    if not cpu_kernels.is_built() or cpu_kernels.extension().best_isa() == "portable":
        sys.exit("the tile layout's kernels need the CPU kernels on an x86 CPU (AVX-512 VNNI or AVX2)")
    print(f"{platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    default = cpu_kernels.extension().tile_layout()
    try:
        if "calls" in args.sections:
            bench_calls(args.copies, args.reps)
        if "model" in args.sections:
            bench_model(args.reps)
    finally:
        cpu_kernels.extension().set_tile_layout(default)


if __name__ == "__main__":
    main()
