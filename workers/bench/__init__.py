"""Load generator and benchmark suite: the same loads against gmlx and mlx_lm.server.

    from gmlx.bench import WorkloadOptions, parse_target, run_benchmark
    results = run_benchmark(WorkloadOptions(kind="closed", concurrency=8),
                            [parse_target("server:drafter=mtp"), parse_target("mlx-lm:drafter=draft")])

`gmlx bench --help` is the command-line face; scripts/bench_suite.py runs the suite that
BENCHMARKS.md reports.
"""

from gmlx.bench.runner import run_benchmark
from gmlx.bench.targets import TargetSpec, parse_target
from gmlx.bench.workload import Lengths, RequestSpec, Workload, WorkloadOptions, make_workload

__all__ = ["Lengths", "RequestSpec", "TargetSpec", "Workload", "WorkloadOptions", "make_workload",
           "parse_target", "run_benchmark"]
