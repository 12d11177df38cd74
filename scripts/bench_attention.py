"""The ragged attention primitive alone: ms for 30 layers of SmolLM2-135M's heads (Hq 9,
Hkv 3, D 64; each layer its own KV, so the keys come from memory as in a forward), T new
positions at the end of S keys, one row, best of --reps. With --old PATH.so the same grid
also runs on another build of the extension (e.g. one built from an earlier commit), loaded
beside this tree's in the same process, the two alternating cell by cell in one table.

    PYTHONPATH=. python3 scripts/bench_attention.py --old /tmp/old/_cpu_kernels.so --cpu-time
    PYTHONPATH=. python3 scripts/bench_attention.py --keys 1500 --new 4 --threads 2
    PYTHONPATH=. python3 scripts/bench_attention.py --kv-dtype float16   # a float16 KV cache

--cpu-time times in process CPU seconds (with 2 threads that counts both threads' work).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this tree's gmlx

import mlx.core as mx  # noqa: E402

from gmlx.platform.timing import best_of_s  # noqa: E402

NUM_LAYERS, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 30, 9, 3, 64


def load_extension(path: str, name: str = "gmlx.platform._cpu_kernels"):
    """The extension module in the file at path (mlx.core is imported first, as it must be);
    another name loads a second build beside it, with its own thread pool."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def layers_fn(ext, num_keys: int, num_new: int, kv_dtype=mx.float32):
    key_q, key_k, key_v = mx.random.split(mx.random.key(num_keys * 100 + num_new), 3)
    q = mx.random.normal((1, NUM_Q_HEADS, num_new, HEAD_DIM), key=key_q)  # (B, Hq, T, D)
    shape = (NUM_LAYERS, 1, NUM_KV_HEADS, num_keys, HEAD_DIM)  # one (B, Hkv, S, D) per layer
    keys, values = (mx.random.normal(shape, key=key).astype(kv_dtype) for key in (key_k, key_v))
    layers = [(keys[i], values[i]) for i in range(NUM_LAYERS)]
    mx.eval(q, layers)
    offset = mx.array([num_keys - num_new], dtype=mx.int32)

    def run():
        mx.eval([ext.ragged_attention(q, k, v, offset, HEAD_DIM**-0.5) for k, v in layers])

    return run


def measure(ext, args) -> dict[str, float]:
    clock = time.process_time if args.cpu_time else time.perf_counter
    results = {}
    for num_threads in args.threads:
        ext.set_num_threads(num_threads)
        for num_keys in args.keys:
            for num_new in args.new:
                run = layers_fn(ext, num_keys, num_new, getattr(mx, args.kv_dtype))
                seconds = best_of_s(run, args.reps, clock=clock)
                results[f"{num_threads},{num_keys},{num_new}"] = 1e3 * seconds
    return results


def compare(args) -> None:
    """Both builds in this process, alternating cell by cell for --rounds; the best is kept."""
    builds = {"old": load_extension(args.old, "gmlx_old._cpu_kernels"), "new": load_extension(args.extension)}
    clock = time.process_time if args.cpu_time else time.perf_counter
    print(f"{platform.machine()}; {'CPU' if args.cpu_time else 'wall'} ms for {NUM_LAYERS} layers (Hq {NUM_Q_HEADS}, "
          f"Hkv {NUM_KV_HEADS}, D {HEAD_DIM}, {args.kv_dtype} KV), best of {args.reps} x {args.rounds} "
          "alternating rounds")
    print("| threads | keys S | new T | old ms | new ms | old / new |")
    print("|---|---|---|---|---|---|")
    for num_threads in args.threads:
        for ext in builds.values():
            ext.set_num_threads(num_threads)
        for num_keys in args.keys:
            for num_new in args.new:
                kv_dtype = getattr(mx, args.kv_dtype)
                fns = {side: layers_fn(ext, num_keys, num_new, kv_dtype) for side, ext in builds.items()}
                best = {side: float("inf") for side in builds}
                for _ in range(args.rounds):
                    for side, fn in fns.items():
                        best[side] = min(best[side], 1e3 * best_of_s(fn, args.reps, clock=clock))
                old, new = best["old"], best["new"]
                print(f"| {num_threads} | {num_keys} | {num_new} | {old:.2f} | {new:.2f} | {old / new:.2f}x |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_so = next((ROOT / "gmlx" / "platform").glob("_cpu_kernels*.so"), None)
    parser.add_argument("--extension", default=str(default_so), help="the build to time (default: this tree's)")
    parser.add_argument("--old", help="a second build to time beside it")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--keys", type=int, nargs="+", default=[160, 1000, 1500, 3000])
    parser.add_argument("--new", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3, help="alternations of old and new (with --old)")
    parser.add_argument("--cpu-time", action="store_true")
    parser.add_argument("--kv-dtype", choices=("float32", "float16"), default="float32",
                        help="the KV cache's dtype (float16: what int8-activation models keep by default)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.old:
        return compare(args)
    results = measure(load_extension(args.extension), args)
    if args.json:
        print(json.dumps(results))
    else:
        for cell, ms in results.items():
            print(f"threads {cell.split(',')[0]}, S {cell.split(',')[1]}, T {cell.split(',')[2]}: {ms:.2f} ms")


if __name__ == "__main__":
    main()
