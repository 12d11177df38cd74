"""Decode speed across values of one of the CPU kernels' same-bits settings, side by side in one
process.

The settings here change how the kernels run, never what they compute (tests/test_cpu_kernels.py
checks each for bits), and take effect on the next product, so one loaded engine serves every
value: scripts/ab.py's ABBA turns, the median of per-rep ratios to the first value. What each
turn times is greedy width-1 decode (--tokens) of SmolLM2 in the chosen compute format, or with
--measure forwards a forward of 1-4 positions at 160 KV tokens (best of 10; a verify's cost,
issue 17) and each count's cost over one. `default` is the setting's default (the setter's -1).

    python3 scripts/bench_kernel_settings.py prefetch_chunks 0,2,4,8,16 --reps 6
    python3 scripts/bench_kernel_settings.py min_pool_macs 262144,65536,600000 --reps 6
    python3 scripts/bench_kernel_settings.py num_threads 2,1 --format float32
    python3 scripts/bench_kernel_settings.py prefetch_chunks default,0,8 --measure forwards --reps 10
    python3 scripts/bench_kernel_settings.py amx 0,1 --measure batch --widths 8,16,32 --reps 8
    python3 scripts/bench_kernel_settings.py gfni 1,0 --model Q5_K_M.gguf --measure forwards --reps 6
    python3 scripts/bench_kernel_settings.py yielding_spin default,0 --reps 10

--measure batch times a forward of one position for each of B rows (B from --widths; a wide
plain decode step) at 160 KV tokens a row, best of 10.
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
import bench_decode_ops  # noqa: E402

from ab import alternate, median_ratio  # noqa: E402
from gmlx.config import EngineConfig, env_overrides  # noqa: E402
from gmlx.engine import Engine  # noqa: E402
from gmlx.models.source import resolve_model_path  # noqa: E402
from gmlx.platform import cpu_kernels  # noqa: E402
from gmlx.platform.timing import best_of_s  # noqa: E402

POSITIONS = (1, 2, 3, 4)

# Setting -> the extension's setter; each is checked for bits across its values in the tests.
SETTERS = {
    "prefetch_chunks": "set_prefetch_chunks",  # one-stream kernels' software prefetch distance
    "min_pool_macs": "set_min_pool_macs",  # smallest product handed to the pool
    "num_threads": "set_num_threads",
    "panel_prefetch_bytes": "set_panel_prefetch_bytes",  # float32 panels' software prefetch distance
    "amx": "set_amx",  # the tiles' groups of 8-16 rows on AMX (1) or VNNI (0)
    "gfni": "set_gfni",  # K5- and K6-tiles' top bits by GFNI (1) or shifts (0)
    "yielding_spin": "set_yielding_spin",  # idle pool workers poll with yields (1, the default) or pause only (0)
}
# Setters that take a switch, not an integer with -1 for the default: the value each -1 means.
SWITCH_DEFAULTS = {"yielding_spin": True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("setting", choices=sorted(SETTERS))
    parser.add_argument("values", help="comma-separated integers or `default`; ratios are to the first")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--format", default="quantized", help="GMLX_CPU_COMPUTE_FORMAT (quantized, float32)")
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--measure", choices=("decode", "forwards", "batch"), default="decode",
                        help="decode: width-1 tok/s; forwards: a forward of 1-4 positions, ms; batch: a forward "
                             "of one position for each of --widths rows, ms")
    parser.add_argument("--widths", default="8,16,32", help="rows of the batch forwards (--measure batch)")
    args = parser.parse_args()
    try:
        values = [-1 if v == "default" else int(v) for v in args.values.split(",")]
    except ValueError:
        parser.error(f"values {args.values!r}: expected comma-separated integers or `default`")
    if len(values) < 2:
        parser.error(f"values {args.values!r}: need at least two to compare")
    if not cpu_kernels.is_available():
        sys.exit("gmlx's CPU kernels are not built or not switched on here")
    with env_overrides({"GMLX_CPU_COMPUTE_FORMAT": args.format}):
        engine = Engine.load(EngineConfig(model_path=str(resolve_model_path(args.model)), prompt_cache_bytes=0))
    setter = make_setter(args.setting)
    gmlx_tok_per_s(engine, 32)  # warm: first-use allocations and the KV heap
    if args.measure == "decode":
        measure = decode_measure(engine, args.tokens)
    elif args.measure == "forwards":
        measure = forwards_measure(engine)
    else:
        measure = batch_measure(engine, [int(w) for w in args.widths.split(",")])

    def run(mode: str) -> dict[str, float]:
        setter(int(mode))
        return measure()

    runs = alternate([str(v) for v in values], args.reps, run)
    setter(-1)  # back to the default (every setter here reads < 0 as "default")
    print(f"{platform.machine()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {args.model} {args.format}, "
          f"{args.reps} ABBA reps, {args.measure}")
    report(args.setting, runs, str(values[0]))


def make_setter(setting: str):
    """The extension's setter for setting, taking the script's integers (-1: the default)."""
    set_value = getattr(cpu_kernels.extension(), SETTERS[setting])
    if setting not in SWITCH_DEFAULTS:
        return set_value
    return lambda value: set_value(SWITCH_DEFAULTS[setting] if value < 0 else value != 0)


def decode_measure(engine: Engine, num_tokens: int):
    """Width-1 greedy decode tok/s, the median of 2 decodes."""
    return lambda: {"tok/s": statistics.median(gmlx_tok_per_s(engine, num_tokens) for _ in range(2))}


def forwards_measure(engine: Engine):
    """A forward of 1-4 positions (ms, best of 10) over a 160-token KV, each one trimmed after."""
    forwards = bench_decode_ops.verify_forwards(engine.target, POSITIONS)
    return lambda: {f"forward {n} ms": 1e3 * best_of_s(fn, 10) for n, fn in forwards.items()}


def batch_measure(engine: Engine, widths: list[int]):
    """A forward of one position for each of B rows (ms, best of 10) over 160-token KVs."""
    forwards = bench_decode_ops.batch_forwards(engine.target, widths)
    return lambda: {f"{n} rows ms": 1e3 * best_of_s(fn, 10) for n, fn in forwards.items()}


def report(setting: str, runs: dict[str, list[dict[str, float]]], base: str) -> None:
    """Per value and measure: the median, the median of per-rep speed ratios to base (> 1: faster),
    how many reps were faster (a 5% effect on these shared boxes needs 15+ reps to show its sign),
    each rep's ratio; for forwards also each position count's cost over one position."""
    print(f"| {setting} | measure | median | speed x {base} (median of per-rep ratios) | reps faster | per rep |")
    print("|---|---|---|---|---|---|")
    for mode, results in runs.items():
        for key in results[0]:
            pairs = [(r[key], b[key]) if key == "tok/s" else (b[key], r[key])
                     for r, b in zip(results, runs[base])]
            num_faster = sum(a > b for a, b in pairs)
            print(f"| {mode} | {key} | {statistics.median(r[key] for r in results):.3f} | {median_ratio(pairs):.3f} | "
                  f"{num_faster} of {len(pairs)} | {', '.join(f'{a / b:.2f}' for a, b in pairs)} |")
    if "forward 1 ms" not in runs[base][0]:
        return
    print(f"\n| {setting} | " + " | ".join(f"{n} / 1 positions" for n in POSITIONS[1:]) + " |")
    print("|---|" + "---|" * (len(POSITIONS) - 1))
    for mode, results in runs.items():
        over = [median_ratio((r[f"forward {n} ms"], r["forward 1 ms"]) for r in results) for n in POSITIONS[1:]]
        print(f"| {mode} | " + " | ".join(f"{o:.2f}" for o in over) + " |")


if __name__ == "__main__":
    main()
