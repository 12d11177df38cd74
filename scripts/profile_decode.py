"""Where a decode step's CPU time goes: each thread's share of the cores and its hottest functions,
with the CPU kernels' functions named (Linux, `perf`).

The installed kernels module is stripped, so perf shows bare addresses in it. This builds a copy
of the same source with its symbol table kept (GMLX_KEEP_SYMBOLS: the same compiler and flags
give the same code, checked by the .text sizes) and names the addresses from it. The decode runs
in this process (greedy, width 1, SmolLM2 by default) while `perf record` samples it.

    python3 scripts/profile_decode.py                       # 4-bit SmolLM2, 5 s of samples
    python3 scripts/profile_decode.py --format float32 --seconds 8 --top 30
    python3 scripts/profile_decode.py --positions 4     # a verify's forwards of 4 positions instead
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this tree's gmlx
sys.path.insert(0, str(ROOT / "scripts"))

from bench_compute_format import gmlx_tok_per_s  # noqa: E402  (sets the BLAS up before mlx)
import bench_decode_ops  # noqa: E402

from gmlx.config import EngineConfig, env_overrides  # noqa: E402
from gmlx.engine import Engine  # noqa: E402
from gmlx.models.source import resolve_model_path  # noqa: E402
from gmlx.platform import cpu_kernels  # noqa: E402

SOURCE = ROOT / "native" / "mlx_cpu_kernels"
# perf report --sort pid,dso,sym: "  12.34%  4242:python3  libfoo.so  [.] symbol"
REPORT_LINE = re.compile(r"\s+([\d.]+)%\s+(\d+):\S+\s+(\S+)\s+\[.\]\s+(.+)$")


def text_size(library: Path) -> int | None:
    """The .text section's size (objdump), to check two builds hold the same code."""
    out = subprocess.run(["objdump", "-h", str(library)], capture_output=True, text=True).stdout
    match = re.search(r"\s\.text\s+([0-9a-f]+)", out)
    return int(match[1], 16) if match else None


def symbol_build(build_dir: Path) -> Path:
    """The kernels built from this tree's source with their symbols kept (cached in build_dir)."""
    build_dir = build_dir.resolve()  # cmake runs inside it: a relative output folder would nest there
    out_dir = build_dir / "out"
    configure = ["cmake", str(SOURCE), f"-DPython_EXECUTABLE={sys.executable}", "-DCMAKE_BUILD_TYPE=Release",
                 "-DGMLX_KEEP_SYMBOLS=ON", f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}"]
    build_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(configure, cwd=build_dir, check=True, capture_output=True)
    subprocess.run(["cmake", "--build", ".", "-j", str(os.cpu_count() or 1)], cwd=build_dir, check=True,
                   capture_output=True)
    return out_dir / ("_cpu_kernels" + sysconfig.get_config_var("EXT_SUFFIX"))


def name_addresses(library: Path, addresses: list[str]) -> dict[str, str]:
    """address -> function (demangled, template arguments kept, parameters dropped)."""
    if not addresses:
        return {}
    out = subprocess.run(["addr2line", "-f", "-C", "-e", str(library), *addresses], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    return {a: re.sub(r"\((?!anonymous).*$", "", f) for a, f in zip(addresses, out[::2])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--format", default="quantized", help="GMLX_CPU_COMPUTE_FORMAT (quantized, float32)")
    parser.add_argument("--seconds", type=float, default=5.0, help="how long perf samples")
    parser.add_argument("--top", type=int, default=20, help="functions listed")
    parser.add_argument("--positions", type=int, default=0,
                        help="sample forwards of this many positions at 160 KV tokens (a verify) instead of decode")
    parser.add_argument("--build-dir", default=str(ROOT / ".cache" / "profile-kernels"))
    args = parser.parse_args()
    for tool in ("perf", "objdump", "addr2line", "cmake"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is not installed here (Linux: apt-get install linux-perf binutils cmake)")
    if not cpu_kernels.is_built():
        sys.exit("gmlx's CPU kernels are not built here: nothing to name")
    installed = Path(cpu_kernels.build_files()[0])
    named = symbol_build(Path(args.build_dir))
    if text_size(named) != text_size(installed):
        print(f"warning: {named} holds other code than {installed} (rebuild gmlx with scripts/setup.sh); "
              "kernel names may be wrong", file=sys.stderr)

    with env_overrides({"GMLX_CPU_COMPUTE_FORMAT": args.format}):
        engine = Engine.load(EngineConfig(model_path=str(resolve_model_path(args.model)), prompt_cache_bytes=0))
    gmlx_tok_per_s(engine, 64)  # warm
    workload, unit = workload_fn(engine, args.positions)
    data = Path(args.build_dir) / "perf.data"
    perf = subprocess.Popen(["perf", "record", "-F", "999", "-p", str(os.getpid()), "-o", str(data)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(0.5)  # perf attached
    rates, deadline = [], time.perf_counter() + args.seconds
    while time.perf_counter() < deadline:
        rates.append(workload())
    perf.send_signal(signal.SIGINT)
    if perf.wait(timeout=60) != 0 and not data.exists():
        sys.exit(f"perf record failed: {perf.stderr.read().decode()[-500:]} (kernel.perf_event_paranoid?)")
    report = subprocess.run(["perf", "report", "-i", str(data), "--sort", "pid,dso,sym", "--stdio"],
                            capture_output=True, text=True, check=True).stdout
    rows = [(float(m[1]), int(m[2]), m[3], m[4].strip()) for m in map(REPORT_LINE.match, report.splitlines()) if m]
    kernels_dso = installed.name
    names = name_addresses(named, sorted({sym for _, _, dso, sym in rows if dso == kernels_dso
                                          and sym.startswith("0x")}))
    by_thread: collections.Counter = collections.Counter()
    by_function: collections.Counter = collections.Counter()
    for percent, tid, dso, sym in rows:
        by_thread[tid] += percent
        where = "kernels" if dso == kernels_dso else Path(dso).name
        by_function[(tid, f"{where}: {names.get(sym, sym)}"[:120])] += percent
    total = sum(by_thread.values())
    num_cores = os.cpu_count() or 1
    busy_cores = _busy_cores(data, args.seconds)
    print(f"{args.model} {args.format}, {len(rates)} runs at {sorted(rates)[len(rates) // 2]:.2f} {unit} (median); "
          f"{busy_cores:.2f} of {num_cores} cores busy in the samples")
    labels = _thread_labels(by_function, os.getpid())
    print("| thread | share of samples | cores |")
    print("|---|---|---|")
    for tid, percent in by_thread.most_common():
        print(f"| {labels.get(tid, tid)} | {percent / total:.1%} | {busy_cores * percent / total:.2f} |")
    print(f"\n| thread | function | share of samples |\n|---|---|---|")
    for (tid, function), percent in by_function.most_common(args.top):
        print(f"| {labels.get(tid, tid)} | {function} | {percent / total:.1%} |")


def workload_fn(engine: Engine, num_positions: int):
    """What perf samples, one run a call: greedy width-1 decode of 128 tokens (its tok/s), or with
    num_positions 20 forwards of that many positions over a 160-token KV (ms a forward)."""
    if num_positions <= 0:
        return (lambda: gmlx_tok_per_s(engine, 128)), "tok/s"
    forward = bench_decode_ops.verify_forwards(engine.target, [num_positions])[num_positions]

    def run() -> float:
        start = time.perf_counter()
        for _ in range(20):
            forward()
        return 1e3 * (time.perf_counter() - start) / 20

    return run, f"ms a {num_positions}-position forward"


def _busy_cores(data: Path, seconds: float) -> float:
    """Samples taken over the samples one fully busy core gives (999 a second) in the span sampled."""
    out = subprocess.run(["perf", "script", "-i", str(data), "-F", "time"], capture_output=True, text=True).stdout
    times = [float(t.rstrip(":")) for t in out.split()]
    span_s = times[-1] - times[0] if len(times) > 1 else seconds
    return len(times) / (999 * span_s) if span_s > 0 else 0.0


def _thread_labels(by_function: collections.Counter, main_tid: int) -> dict[int, str]:
    """Python (this thread), the kernels' pool worker (its loop shows) and mlx's stream thread."""
    labels = {main_tid: f"Python {main_tid}"}
    for tid, function in by_function:
        if tid != main_tid and "ThreadPool::worker_loop" in function:
            labels[tid] = f"pool worker {tid}"
    for tid, _ in by_function:
        labels.setdefault(tid, f"mlx stream / other {tid}")
    return labels


if __name__ == "__main__":
    main()
