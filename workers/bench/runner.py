"""Run one workload against several targets side by side and compare them.

Every target is started once and warmed up. For each concurrency level and repeat, one
workload is built (seeded by the repeat, so prompt caches cannot carry over between
repeats) and run against every target in turn, alternating the order between repeats so
a drift in machine load does not always favour the same side. Each figure is the median
over repeats, and each ratio is between two such medians; the per-repeat ratios are kept
in the results too.

A process's own speed can differ from an identical one's for its whole life (two plain
SmolLM2 servers, 16 clients, six repeats: 1.08x apart), and repeats do not average that out.
With restart_per_repeat every target is started afresh for each repeat (repeats then run
outermost, every level inside one process), so each repeat's ratio draws new processes.
"""

from __future__ import annotations

import logging
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from workers.bench import model_files
from workers.bench.machine import machine_notes
from workers.bench.metrics import ratio, summarize
from workers.bench.progress import Progress
from workers.bench.targets import TargetSpec
from workers.bench.workload import WorkloadOptions, make_workload

logger = logging.getLogger(__name__)

RESULTS_FORMAT = 1
COMPARED = {  # name -> (summary path); a ratio is this target's value over the baseline's
    "aggregate_tok_per_s": ("aggregate_tok_per_s",),
    "ttft_p50_s": ("ttft_s", "p50"),
    "ttft_p95_s": ("ttft_s", "p95"),
    "ttft_p99_s": ("ttft_s", "p99"),
    "itl_p50_s": ("itl_s", "p50"),
    "itl_p95_s": ("itl_s", "p95"),
    "stream_tok_per_s_p50": ("stream_tok_per_s", "p50"),
    "arrival_ttft_p95_s": ("groups", "arrival", "ttft_s", "p95"),  # scripted load: the arrivals
    "long_stream_tok_per_s": ("groups", "long", "stream_tok_per_s", "p50"),  # scripted load: the lone stream
}


def make_target(spec: TargetSpec, workdir, max_concurrency: int = 8):
    """The runnable target for a spec; start() it before running workloads."""
    if spec.kind == "engine":
        from workers.bench.engine_target import EngineTarget

        return EngineTarget(spec)
    if spec.kind == "llama-server":
        from workers.bench.llama_server import LlamaServerTarget

        return LlamaServerTarget(spec, workdir, default_num_slots=max_concurrency)
    from workers.bench.remote import GmlxServerTarget, MlxLmTarget

    return GmlxServerTarget(spec, workdir) if spec.kind == "server" else MlxLmTarget(spec, workdir)


def wait_for_model(folder: Path, timeout_s: float = 1800.0) -> None:
    """The built-in model may still be training: poll until its folder is complete."""
    deadline_s = time.monotonic() + timeout_s
    while not ((folder / "config.json").exists() and any(folder.glob("*.safetensors"))
               and (folder / "tokenizer.json").exists()):
        if time.monotonic() > deadline_s:
            raise ValueError(f"model {folder}: not found (waited {timeout_s:.0f} s)")
        logger.warning("waiting for the model at %s", folder)
        time.sleep(15.0)


def run_benchmark(options: WorkloadOptions, specs: list[TargetSpec], *, concurrencies: list[int] | None = None,
                  repeats: int = 1, is_warmup: bool = True, timeout_s: float = 600.0, is_progress: bool = True,
                  baseline: str | None = None, workdir: Path | None = None, command: str | None = None,
                  restart_per_repeat: bool = False) -> dict:
    """Run the workload against every target; returns the results document (JSON-ready)."""
    if not specs:
        raise ValueError("targets: give at least one")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"targets: two have the same name {names}; give one a label=")
    if baseline is not None and baseline not in names:
        raise ValueError(f"baseline {baseline!r}: not one of the targets {names}")
    source = model_files.model_source(specs[0].model)
    if not model_files.is_gguf(source):
        wait_for_model(source)
    # A GGUF's tokenizer.json comes from its converted folder: the tokenizer gmlx builds from it.
    tokenizer_file = model_files.mlx_lm_folder(specs[0].model) / "tokenizer.json"
    levels = (concurrencies or [options.concurrency]) if options.kind == "closed" else [None]
    is_own_workdir = workdir is None  # server logs live here; kept only when something failed
    workdir = Path(workdir or tempfile.mkdtemp(prefix="gmlx-bench-"))
    max_concurrency = max(levels) if levels[0] is not None else options.concurrency
    targets = [make_target(s, workdir, max_concurrency) for s in specs]
    started, runs, workload_notes = [], [], None
    notes, identity = machine_notes(), model_files.model_identity(source)
    started_unix_s, start_s = time.time(), time.perf_counter()
    try:
        def bring_up(target) -> None:
            target.start()
            if is_warmup:
                _warm_up(target, options, tokenizer_file, timeout_s)

        for target in targets:
            started.append(target)  # stopped at the end even if its start fails half way (stop is idempotent)
            bring_up(target)
        for repeat, level in _schedule(levels, repeats, restart_per_repeat):
            if restart_per_repeat and repeat and level == levels[0]:
                for target in targets:
                    target.stop()
                    bring_up(target)
            level_options = options if level is None else replace(options, concurrency=level)
            workload = make_workload(replace(level_options, seed=options.seed + repeat), tokenizer_file)
            workload_notes = workload_notes or workload.describe()
            order = targets if repeat % 2 == 0 else targets[::-1]
            for target in order:
                runs.append(_run_one(target, workload, level, repeat, timeout_s, is_progress))
        described = [t.describe() for t in targets]
    except BaseException:
        logger.error("server logs kept in %s", workdir)
        raise
    finally:
        for target in started:
            target.stop()
    if any(r["summary"]["num_errors"] for r in runs):
        logger.warning("some requests failed; server logs kept in %s", workdir)
    elif is_own_workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    base = baseline or names[0]
    return {
        "format": RESULTS_FORMAT,
        "command": command,
        "started_unix_s": started_unix_s,
        "wall_s": time.perf_counter() - start_s,
        "machine": notes,
        "model": identity,
        "workload": {**(workload_notes or {}), "concurrency_levels": levels, "repeats": repeats,
                     "restart_per_repeat": restart_per_repeat},
        "targets": described,
        "baseline": base,
        "runs": runs,
        "table": make_table(runs, names, levels, base),
    }


def _schedule(levels: list, repeats: int, restart_per_repeat: bool) -> list[tuple[int, object]]:
    """(repeat, level) in run order: each level's repeats together, or, restarting, each
    repeat's levels together (one set of processes serves a whole repeat)."""
    if restart_per_repeat:
        return [(repeat, level) for repeat in range(repeats) for level in levels]
    return [(repeat, level) for level in levels for repeat in range(repeats)]


def _warm_up(target, options: WorkloadOptions, tokenizer_file: Path, timeout_s: float) -> None:
    """A lone request (scalar path) then two together (batch path), on prompts the run never uses."""
    for concurrency, num in ((1, 1), (2, 2)):
        warm = WorkloadOptions(kind="closed", num_requests=num, concurrency=concurrency, prompt_tokens="16",
                               max_tokens="8", temperature=options.temperature, seed=options.seed + 10_000)
        target.run(make_workload(warm, tokenizer_file), Progress(num, "warm-up", is_enabled=False), timeout_s)


def _run_one(target, workload, level, repeat: int, timeout_s: float, is_progress: bool) -> dict:
    name = target.spec.name
    label = name + (f" c={level}" if level is not None else "") + f" #{repeat + 1}"
    progress = Progress(len(workload.requests), label, is_enabled=is_progress)
    out = target.run(workload, progress, timeout_s)
    progress.close()
    records = out["records"]
    summary = summarize(records, out["counters"])
    if summary["num_errors"]:
        first = next(r for r in records if r.error)
        logger.warning("%s: %d requests failed, first: %s", label, summary["num_errors"], first.error)
    engine_stats = out.get("server_stats") or {}
    return {"target": name, "level": level, "repeat": repeat, "summary": summary, "counters": out["counters"],
            "events": out["events"], "calibration": _per_engine(engine_stats, "calibration"),
            "draft_depth": _per_engine(engine_stats, "draft_depth"),
            "streams": [r.to_json() for r in sorted(records, key=lambda r: r.index)]}


def _per_engine(stats: dict, key: str) -> list:
    """One entry of each engine's stats after the run (one per worker): `calibration` (its cost
    table and served correction), `draft_depth` (its depth policy's estimates and ledger)."""
    engines = stats.get("workers") or [stats]
    return [e[key] for e in engines if e.get(key) is not None]


def _get(summary: dict, path: tuple[str, ...]):
    value = summary
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def make_table(runs: list[dict], names: list[str], levels: list, baseline: str) -> list[dict]:
    """One row per (level, target): medians over repeats, and their ratios to the baseline's."""
    rows = []
    for level in levels:
        by_key = {(r["target"], r["repeat"]): r for r in runs if r["level"] == level}
        repeats = sorted({rep for _, rep in by_key})
        for name in names:
            mine = [by_key[(name, rep)]["summary"] for rep in repeats if (name, rep) in by_key]
            row = {"level": level, "target": name, "num_repeats": len(mine)}
            for key, path in COMPARED.items():
                row[key] = _median([_get(s, path) for s in mine])
            row["acceptance_rate"] = _median([s["acceptance_rate"] for s in mine])
            row["num_errors"] = sum(s["num_errors"] for s in mine)
            row["transport_p95_s"] = _median([_get(s, ("transport_s", "p95")) for s in mine])
            row["transitions"] = {k: _median([s["transitions"].get(k) for s in mine])
                                  for k in (mine[0]["transitions"] if mine else {})}
            row["num_preempted_streams"] = _median([s["num_preempted_streams"] for s in mine])
            rows.append(row)
        base_row = next(r for r in rows if r["level"] == level and r["target"] == baseline)
        for row in rows:
            if row["level"] != level:
                continue
            # Ratios of the medians shown; each repeat's own ratios are kept beside them.
            row["vs_baseline"] = {key: ratio(row[key], base_row[key]) for key in COMPARED}
            row["vs_baseline_per_repeat"] = {
                key: [ratio(_get(by_key[(row["target"], rep)]["summary"], path),
                            _get(by_key[(baseline, rep)]["summary"], path))
                      for rep in repeats if (row["target"], rep) in by_key and (baseline, rep) in by_key]
                for key, path in COMPARED.items()}
    return rows
