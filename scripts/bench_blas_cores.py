"""Every OpenBLAS core this CPU can run, side by side: matmul, one-row rate, decode speed.

OpenBLAS fixes its kernels when it loads, so each core runs in its own child process
(OPENBLAS_CORETYPE=<core>), and one more child runs gmlx's default start-up choice
("auto"). Children take turns, the order reversed every rep; the table shows each
figure's median over reps and the ratio of every row's decode speed to the best forced
core's, measured in the same run.

    python scripts/bench_blas_cores.py                        # built-in model + 120M random qwen3
    python scripts/bench_blas_cores.py --reps 3 --tokens 48
    python scripts/bench_blas_cores.py --lib PATH/libscipy_openblas.so   # another OpenBLAS beside the default

Prints a markdown table (for BENCHMARKS.md) and one JSON line.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_blas.py beside this file
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ab import alternate  # noqa: E402

CORES = ("Prescott", "Haswell", "Zen", "SkylakeX", "Cooperlake", "SapphireRapids")
AUTO = "auto"


def one_row_gbs(num_reps: int = 10) -> float:
    """(1, 4096) @ (4096, 4096).T through mlx: 64 MiB of weights per call, read from DRAM."""
    import mlx.core as mx

    from gmlx.platform.timing import best_of_s

    w, x = mx.random.normal((4096, 4096)), mx.random.normal((1, 4096))
    mx.eval(w, x)
    return w.nbytes / best_of_s(lambda: mx.eval(x @ w.T), num_reps) / 1e9


def child(args) -> dict:
    from gmlx.platform.blas import ensure_fast_blas

    ensure_fast_blas()
    import bench_blas
    import mlx.core as mx

    from gmlx.config import is_cpu_fusion_enabled, is_input_major_enabled
    from gmlx.platform.blas import describe_blas

    d = describe_blas(measure=True)
    out = {"core": d.get("openblas_corename"), "library": f"{Path(d['library']).name} {d.get('openblas_version')}",
           "is_routing": d["is_interposer_active"],
           "matmul_ms": d["matmul_1024_ms"], "one_row_gbs": one_row_gbs(), "decode": {}}
    for label, random_params in (("built-in", None), ("120M", "120M")):
        model_args = argparse.Namespace(model="builtin", random_params=random_params)
        model, prompt, _ = bench_blas.prepare(model_args, is_cpu_fusion_enabled(), is_input_major_enabled())
        tokens, tok_s = bench_blas.decode(model, prompt, args.warmup, args.tokens)
        out["decode"][label] = {"tok_s": tok_s, "tokens": tokens}
        del model
        mx.clear_cache()
    return out


def run_child(args, mode: tuple[str | None, str]) -> dict:
    lib, core = mode
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "GMLX_BLAS_CORE_CHOSEN")}
    if lib is not None:
        env["GMLX_BLAS_LIB"] = lib
    if core != AUTO:
        env["OPENBLAS_CORETYPE"] = core
    argv = [sys.executable, os.path.abspath(__file__), "--child", "--tokens", str(args.tokens),
            "--warmup", str(args.warmup)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"child {core} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def runnable_cores() -> list[str]:
    from gmlx.platform.blas_cores import X86_CORE_FLAGS, is_x86
    from gmlx.platform.blas_select import cpu_flags

    if not is_x86(platform.machine()):
        return []
    flags = cpu_flags()
    return [c for c in CORES if X86_CORE_FLAGS[c] <= flags]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32, help="decode steps timed per model and run")
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--reps", type=int, default=2, help="runs per core, order reversed every rep")
    parser.add_argument("--lib", action="append", default=[],
                        help="also run every core of this OpenBLAS library (GMLX_BLAS_LIB); repeatable")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    from gmlx.platform.blas_select import cpu_model_name

    modes = [(lib, core) for lib in (None, *args.lib) for core in (AUTO, *runnable_cores())]
    unknown = set()  # cores this OpenBLAS does not know (it runs another): dropped from the table

    def run(mode: tuple) -> dict | None:
        if mode in unknown:
            return None
        result = run_child(args, mode)
        if mode[1] != AUTO and result["core"] != mode[1]:
            unknown.add(mode)
            return None
        result["library"] = result.get("library") or mode[0]
        print(f"{mode}: {result['core']} {result['decode']}", file=sys.stderr, flush=True)
        return result

    runs = {m: rs for m, rs in alternate(modes, args.reps, run).items() if m not in unknown}
    report(args, runs, cpu_model_name())


def report(args, runs: dict, cpu: str) -> None:
    def med(mode, *path):
        values = []
        for r in runs[mode]:
            v = r
            for key in path:
                v = v[key]
            values.append(v)
        return statistics.median(values)

    labels = ("built-in", "120M")
    forced = [m for m in runs if m[1] != AUTO]
    best = {lab: max(forced, key=lambda m: med(m, "decode", lab, "tok_s")) for lab in labels}
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\n{cpu}, {os.cpu_count()} cores, {now}; `python scripts/bench_blas_cores.py --reps {args.reps} "
          f"--tokens {args.tokens}`; medians of {args.reps} reps\n")
    print("| library | core | kernels run | interposer | 1024² matmul ms | one-row GB/s | built-in tok/s (vs best) "
          "| 120M tok/s (vs best) |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in runs:
        first = runs[mode][0]
        cells = [f"{med(mode, 'decode', lab, 'tok_s'):.1f} ({med(mode, 'decode', lab, 'tok_s') / med(best[lab], 'decode', lab, 'tok_s'):.2f})"
                 for lab in labels]
        name = "default (gmlx's choice)" if mode[1] == AUTO else mode[1]
        print(f"| {first['library']} | {name} | {first['core']} | {'routing' if first['is_routing'] else 'pass-through'} | "
              f"{med(mode, 'matmul_ms'):.1f} | {med(mode, 'one_row_gbs'):.1f} | {cells[0]} | {cells[1]} |")
    same = {lab: len({tuple(r["decode"][lab]["tokens"]) for m in runs for r in runs[m]}) == 1 for lab in labels}
    print(f"\nbest forced core: {best}; greedy tokens identical across cores: {same}")
    summary = {f"{m[0] or 'default'}:{m[1]}": [{"core": r["core"], "matmul_ms": r["matmul_ms"],
                                                  "one_row_gbs": r["one_row_gbs"], "is_routing": r["is_routing"],
                                                  **{f"{lab}_tok_s": r["decode"][lab]["tok_s"] for lab in labels}}
                                                 for r in rs] for m, rs in runs.items()}
    print(json.dumps({"cpu": cpu, "date": now, "runs": summary}))


if __name__ == "__main__":
    main()
