"""Time to load a GGUF, gmlx against llama.cpp, side by side in one run: each repeat runs every
side once in a fresh process, in alternating order; medians reported.

gmlx: `Engine.load` in a fresh process (what `gmlx serve` does before it serves), timed inside
that process, and the process's wall time from start to a loaded engine (imports included).
llama.cpp: `llama-completion -m FILE -n 1` (load, one prompt token, one token out), its own
"load time" line and the process's wall time. Both read the file from the page cache: the first
repeat of each side is a warm-up and is dropped.

    python3 scripts/bench_load.py --gguf /tmp/big/big-q4km.gguf --repeats 5 \
        --llama-completion .cache/llama.cpp/bin/llama-completion
    python3 scripts/bench_load.py --gguf A.gguf --gguf B.gguf --gmlx-root /tmp/old --label-root "before"

--gmlx-root adds another gmlx tree (an older commit's worktree, its extension built there) as a
side of its own, for before/after ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Run in the child: load the engine as `gmlx serve` does and print what it took.
_CHILD = """
import json, sys, time
started = time.perf_counter()
from gmlx.platform.blas import ensure_fast_blas
ensure_fast_blas()
from gmlx.config import EngineConfig
from gmlx.engine import Engine
imported = time.perf_counter()
Engine.load(EngineConfig(model_path=sys.argv[1]))
print(json.dumps({"load_s": time.perf_counter() - imported, "imports_s": imported - started}))
"""


def gmlx_side(root: Path, gguf: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root)}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _CHILD, str(gguf)], env=env, cwd=root, capture_output=True,
                          text=True, check=True)
    wall_s = time.perf_counter() - started
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "wall_s": wall_s}


def llama_side(binary: Path, gguf: Path, num_threads: int) -> dict:
    started = time.perf_counter()
    done = subprocess.run([str(binary), "-m", str(gguf), "-n", "1", "-p", "Hi", "-t", str(num_threads), "-no-cnv",
                           "--no-warmup"], capture_output=True, text=True, errors="replace", check=True,
                          stdin=subprocess.DEVNULL)  # a random model's token may be no UTF-8
    wall_s = time.perf_counter() - started
    found = re.search(r"load time\s*=\s*([\d.]+) ms", done.stdout + done.stderr)
    return {"load_s": float(found.group(1)) / 1e3 if found else float("nan"), "wall_s": wall_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", action="append", required=True, type=Path)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--llama-completion", type=Path, default=ROOT / ".cache/llama.cpp/bin/llama-completion")
    parser.add_argument("--gmlx-root", type=Path, help="another gmlx tree, run as a side of its own")
    parser.add_argument("--label-root", default="gmlx (other tree)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    sides = {"gmlx": lambda f: gmlx_side(ROOT, f)}
    if args.gmlx_root:
        sides[args.label_root] = lambda f: gmlx_side(args.gmlx_root.resolve(), f)
    if args.llama_completion.exists():
        sides["llama.cpp"] = lambda f: llama_side(args.llama_completion, f, args.threads)
    report = {"cpu": platform.processor() or platform.machine(), "repeats": args.repeats, "files": {},
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for gguf in args.gguf:
        runs = {side: [] for side in sides}
        for repeat in range(args.repeats + 1):  # repeat 0 warms the page cache and is dropped
            order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
            for side in order:
                result = sides[side](gguf)
                if repeat:
                    runs[side].append(result)
        report["files"][str(gguf)] = {
            "bytes": gguf.stat().st_size,
            "sides": {side: {key: statistics.median(r[key] for r in results) for key in results[0]}
                      for side, results in runs.items()},
        }
    if args.json:
        print(json.dumps(report))
        return
    print(f"{report['cpu']}, {report['date']}, median of {args.repeats} (a warm-up dropped), {args.threads} threads")
    print("| file | MB | side | load s | process wall s | wall / gmlx |")
    print("|---|---|---|---|---|---|")
    for path, entry in report["files"].items():
        gmlx_wall = entry["sides"]["gmlx"]["wall_s"]
        for side, medians in entry["sides"].items():
            print(f"| {Path(path).name} | {entry['bytes'] / 1e6:.0f} | {side} | {medians['load_s']:.2f} | "
                  f"{medians['wall_s']:.2f} | {medians['wall_s'] / gmlx_wall:.2f} |")


if __name__ == "__main__":
    main()
