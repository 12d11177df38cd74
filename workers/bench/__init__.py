"""Load generator and benchmark suite: the same loads against gmlx, mlx_lm.server and llama-server.

    from workers.bench import WorkloadOptions, parse_target, run_benchmark
    results = run_benchmark(WorkloadOptions(kind="closed", concurrency=8),
                            [parse_target("server:drafter=mtp"), parse_target("mlx-lm:drafter=draft")])

`gmlx bench --help` is the command-line face; scripts/bench_suite.py runs the suite that
BENCHMARKS.md reports.
"""

from workers.bench.runner import run_benchmark
from workers.bench.targets import TargetSpec, parse_target
from workers.bench.workload import Lengths, RequestSpec, Workload, WorkloadOptions, make_workload

__all__ = ["Lengths", "RequestSpec", "TargetSpec", "Workload", "WorkloadOptions", "make_workload",
           "parse_target", "run_benchmark"]
