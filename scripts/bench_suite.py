#!/usr/bin/env python
"""Run the load-generator benchmark suite and rewrite its section of BENCHMARKS.md.

Four benchmarks, each one `gmlx bench` invocation whose targets run side by side:
  vs-mlx-lm  8 concurrent clients with a drafter: gmlx server against mlx_lm.server
  sweep      closed-loop concurrency 1..32, plain against speculative, and the knee
  poisson    mixed Poisson load with preempt and resume on and off
  scripted   one long speculating stream, then arrivals: preempt on and off

    python scripts/bench_suite.py             # the whole suite (about 10 minutes here)
    python scripts/bench_suite.py --quick     # fewer requests and repeats (about 5 minutes)
    python scripts/bench_suite.py --only sweep --no-write

Only the text between <!-- bench_suite:begin --> and <!-- bench_suite:end --> in
BENCHMARKS.md is replaced; the rest of the file belongs to others. JSON results and PNG
plots go to --out-dir (default runs/bench/, not committed).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from workers.bench import report  # noqa: E402
from workers.bench.metrics import ratio  # noqa: E402
from workers.bench.plots import make_plots  # noqa: E402
from workers.bench.runner import make_table  # noqa: E402

BUILTIN = REPO_ROOT / "gmlx" / "models" / "builtin"
BEGIN, END = "<!-- bench_suite:begin -->", "<!-- bench_suite:end -->"
GOAL_TOK_RATIO, GOAL_TTFT_RATIO = 3.0, 0.2


def drafters(args) -> dict[str, str]:
    """Drafter specs for the built-in model, or for the folders given on the command line."""
    if args.model is None:
        return {"draft": "draft", "mtp": "mtp"}
    return {"draft": f"draft:{args.draft}", "mtp": f"mtp:{args.mtp}"}


def scenarios(args) -> tuple[dict[str, dict], list[str]]:
    q = args.quick
    d = drafters(args)
    common = ["--model", args.model] if args.model else []
    table = {
        "vs-mlx-lm": dict(
            title="8 concurrent clients with a drafter: gmlx against mlx_lm.server",
            argv=["--target", f"mlx-lm:drafter={d['draft']},label=mlx-lm + draft model",
                  "--target", f"server:drafter={d['draft']},label=gmlx + draft model",
                  "--target", f"server:drafter={d['mtp']},label=gmlx + mtp",
                  "--target", "mlx-lm:drafter=none,label=mlx-lm plain (batched)",
                  *([] if q else ["--target", f"engine:drafter={d['draft']},label=gmlx in-process + draft model"]),
                  "--load", "closed", "--concurrency", "8", "--num-requests", "16" if q else "24",
                  "--prompt-tokens", "uniform:32,96", "--max-tokens", "64", "--repeats", "1" if q else "2"]),
        "sweep": dict(
            title="Concurrency sweep, plain against speculative (gmlx server)",
            argv=["--target", "server:drafter=none,label=plain",
                  "--target", f"server:drafter={d['mtp']},label=mtp",
                  *([] if q else ["--target", f"server:drafter={d['mtp']},width_cap=0,label=mtp uncapped"]),
                  "--load", "closed", "--concurrency", "1,2,4,8,16,32",  # 2 requests per client
                  "--prompt-tokens", "uniform:16,64", "--max-tokens", "32" if q else "48",
                  "--repeats", "1" if q else "2"]),
        "poisson": dict(
            title="Mixed Poisson load, preempt and resume on and off (in-process engine, mtp)",
            argv=["--target", f"engine:drafter={d['mtp']},label=preempt+resume",
                  "--target", f"engine:drafter={d['mtp']},preempt=0,label=no preempt",
                  "--target", f"engine:drafter={d['mtp']},resume=0,label=no resume",
                  "--target", f"engine:drafter={d['mtp']},preempt=0,resume=0,label=neither",
                  "--load", "poisson", "--rate", str(args.rate), "--num-requests", "20" if q else "32",
                  "--prompt-tokens", "uniform:16,64", "--max-tokens", "lognormal:48,0.8,192",
                  "--repeats", "1" if q else "2"]),
        "scripted": dict(
            title="One long speculating stream, then arrivals (in-process engine, mtp)",
            argv=["--target", f"engine:drafter={d['mtp']},label=preempt on",
                  "--target", f"engine:drafter={d['mtp']},preempt=0,label=preempt off",
                  "--load", "scripted", "--num-requests", "5", "--long-max-tokens", "256",
                  "--arrival-delay-s", "0.5", "--arrival-interval-s", "0.25", "--prompt-tokens", "uniform:32,64",
                  "--max-tokens", "48", "--repeats", "1" if q else "3"]),
    }
    if args.grown:
        # The same comparison on the built-in target grown with inert parameters: the cost of
        # a larger model, the built-in model's real acceptance (scripts/bench_models.py).
        grown = grown_model(args)
        argv = [a.replace("drafter=draft", f"drafter=draft:{BUILTIN / 'draft'}")
                 .replace("drafter=mtp", f"drafter=mtp:{BUILTIN / 'mtp'}") for a in table["vs-mlx-lm"]["argv"]]
        table["vs-mlx-lm-grown"] = dict(
            title=f"The same 8 clients on an inert-grown built-in model ({args.grown}: intermediate size, "
                  f"extra layers; real acceptance, larger-model cost)",
            argv=argv + ["--model", str(grown)])
    return table, common


def grown_model(args) -> Path:
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    from bench_models import grow_inert

    intermediate, extra_layers = (int(x) for x in args.grown.split(","))
    return grow_inert(args.out_dir / f"inert-grown-{intermediate}-{extra_layers}", intermediate, extra_layers)


def run_scenario(name: str, scenario: dict, common: list[str], out_dir: Path, timeout_s: float) -> dict:
    argv = scenario["argv"] + common
    json_path = out_dir / f"{name}.json"
    cmd = [sys.executable, "-m", "workers.bench.cli", *argv, "--out", str(json_path), "--plots",
           str(out_dir / "plots" / name), "--quiet"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH"))))}
    env.setdefault("GMLX_LOG_LEVEL", "WARNING")
    print(f"\n=== {name}: gmlx bench {' '.join(shlex.quote(a) for a in argv)}", file=sys.stderr, flush=True)
    start_s = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, timeout=timeout_s, stdout=subprocess.PIPE, text=True)
    print(proc.stdout, file=sys.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed with exit code {proc.returncode}")
    results = json.loads(json_path.read_text())
    results["suite_command"] = "gmlx bench " + " ".join(shlex.quote(a) for a in argv)
    results["suite_wall_s"] = time.perf_counter() - start_s
    return results


# --- the section ------------------------------------------------------------------------

def _row(results: dict, target: str, level=None) -> dict | None:
    return next((r for r in results["table"] if r["target"] == target and (level is None or r["level"] == level)),
                None)


def _verdict(value, goal: float, is_at_least: bool) -> str:
    if value is None:
        return "not measured"
    met = value >= goal if is_at_least else value <= goal
    return f"goal {'>=' if is_at_least else '<='} {goal:g}x: {'met' if met else 'NOT met'}"


def headline_vs_mlx_lm(res: dict) -> list[str]:
    lines = []
    for name in ("gmlx + draft model", "gmlx + mtp"):
        row = _row(res, name)
        if row is None:
            continue
        tok, ttft = row["vs_baseline"]["aggregate_tok_per_s"], row["vs_baseline"]["ttft_p95_s"]
        lines.append(f"- **{name}** against mlx-lm + draft model: aggregate tokens/s **{report.times(tok)}** "
                     f"({_verdict(tok, GOAL_TOK_RATIO, True)}), p95 time to first token **{report.times(ttft)}** "
                     f"({_verdict(ttft, GOAL_TTFT_RATIO, False)}); gmlx acceptance "
                     f"{report.fmt(row['acceptance_rate'])}.")
    engine, server = _row(res, "gmlx in-process + draft model"), _row(res, "gmlx + draft model")
    if engine is not None and server is not None:
        lines.append(f"- The same engine in-process (no front-end, no IPC) reaches "
                     f"{report.times(engine['vs_baseline']['aggregate_tok_per_s'])} of mlx-lm + draft model, "
                     f"against {report.times(server['vs_baseline']['aggregate_tok_per_s'])} through the server: "
                     f"what the serving path costs or hides on this 2-core machine, within its noise.")
    plain = _row(res, "mlx-lm plain (batched)")
    if plain is not None:
        lines.append(f"- mlx-lm without its drafter (so it batches) reaches "
                     f"{report.times(plain['vs_baseline']['aggregate_tok_per_s'])} of its own speculative "
                     f"aggregate: the price of mlx-lm serving a speculative request alone.")
        for name in ("gmlx + draft model", "gmlx + mtp"):
            row = _row(res, name)
            if row is not None:
                tok = ratio(row["aggregate_tok_per_s"], plain["aggregate_tok_per_s"])
                ttft = ratio(row["ttft_p95_s"], plain["ttft_p95_s"])
                lines.append(f"- {name} against mlx-lm's best setting here (plain, batched): aggregate tokens/s "
                             f"{report.times(tok)}, p95 time to first token {report.times(ttft)}.")
    return lines


def headline_sweep(res: dict) -> list[str]:
    lines = []
    targets = list(dict.fromkeys(r["target"] for r in res["table"]))
    top_level = max(r["level"] for r in res["table"])
    for target in targets:
        k = report.knee(res, target)
        if k and k["knee_concurrency"] < top_level:
            lines.append(f"- knee of **{target}**: concurrency {k['knee_concurrency']} already reaches 90% of its "
                         f"best {k['best_tok_per_s']:.0f} tok/s.")
        elif k:
            lines.append(f"- **{target}**: no knee within 1-{top_level}; throughput is still rising at "
                         f"{top_level} clients ({k['best_tok_per_s']:.0f} tok/s).")
    for target in targets[1:]:
        ratios = [(r["level"], r["vs_baseline"]["aggregate_tok_per_s"], r["acceptance_rate"])
                  for r in res["table"] if r["target"] == target]
        cells = ", ".join(f"c={lv}: {report.times(x)} (acc {report.fmt(a)})" for lv, x, a in ratios)
        lines.append(f"- {target} over plain, aggregate tokens/s: {cells}.")
    return lines


def headline_ab(res: dict, key: str, what: str) -> list[str]:
    lines = []
    for row in res["table"]:
        if row["target"] == res["baseline"]:
            continue
        lines.append(f"- **{row['target']}** against {res['baseline']}: {what} "
                     f"{report.times(row['vs_baseline'][key])}, aggregate tokens/s "
                     f"{report.times(row['vs_baseline']['aggregate_tok_per_s'])}, acceptance "
                     f"{report.fmt(row['acceptance_rate'])} (baseline "
                     f"{report.fmt(_row(res, res['baseline'])['acceptance_rate'])}).")
    return lines


HEADLINES = {
    "vs-mlx-lm": headline_vs_mlx_lm,
    "vs-mlx-lm-grown": headline_vs_mlx_lm,
    "sweep": headline_sweep,
    "poisson": lambda res: headline_ab(res, "ttft_p95_s", "p95 time to first token"),
    "scripted": lambda res: headline_ab(res, "arrival_ttft_p95_s", "arrivals' p95 time to first token"),
}


def model_notes(args, results: dict) -> str:
    """What was measured, from the results (the folder can change after a run)."""
    measured = results.get("model") or {}
    folder = Path(measured.get("path") or args.model or BUILTIN / "target")
    digest = measured.get("weights_sha1", "?")
    metrics_path = BUILTIN / "metrics.json"
    if folder.resolve() == (BUILTIN / "target").resolve() and metrics_path.exists():
        m = json.loads(metrics_path.read_text())
        return (f"built-in model (gmlx/models/builtin, weights sha1 {digest}): target "
                f"{m.get('target_params', 0) / 1e6:.2f}M params, held-out loss "
                f"{m.get('target_heldout_loss_nats', float('nan')):.2f} nats/token; draft model "
                f"{m.get('draft_params', 0) / 1e6:.2f}M; MTP head {m.get('mtp_params', 0) / 1e6:.2f}M; trained on "
                f"the Python standard library; prompts are slices of the {m.get('heldout_files', '?')} held-out files")
    if folder.resolve() == (BUILTIN / "target").resolve():
        return (f"built-in model folder (weights sha1 {digest}) WITHOUT metrics.json: not the trained release "
                f"(a placeholder or a model still training); acceptance rates are not representative")
    if args.model is None:  # --grown: the built-in target with inert parameters, built-in drafters
        return (f"model `{_shown_path(folder)}` (weights sha1 {digest}): the built-in target grown with inert "
                f"parameters (scripts/bench_models.py; real acceptance, larger-model cost), with the built-in "
                f"draft model and MTP head")
    return f"model `{_shown_path(folder)}` (weights sha1 {digest}), draft model {args.draft}, MTP head {args.mtp}"


BLAS_KEYS = ("library", "openblas_version", "num_threads", "interposer_status", "matmul_1024_ms")


def machine_line(notes: dict) -> str:
    blas = notes["blas"]
    if isinstance(blas, dict):
        blas = ", ".join(f"{k} {blas[k]:.1f}" if isinstance(blas[k], float) else f"{k} {blas[k]}"
                         for k in BLAS_KEYS if k in blas)
    return (f"{notes['cpu_model']}, {notes['usable_cores']} usable cores ({notes['logical_cores']} logical), "
            f"{notes['memory_gib']} GiB; load average {notes['load_average_1m_at_start']:.2f} at start "
            f"(the machine is shared); {notes['platform']}; Python {notes['python']}, mlx {notes['mlx']}, "
            f"mlx-lm {notes['mlx_lm']}; BLAS (gmlx.platform.blas.describe_blas()): {blas}; commit "
            f"{notes['git_commit']}")


def make_section(all_results: dict, args, wall_s: float) -> str:
    first = next(iter(all_results.values()))
    notes = first["machine"]  # as captured when the first benchmark started
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(first.get("started_unix_s") or first["created_unix_s"]))
    flags = (" --quick" if args.quick else "") + (f" --grown {args.grown}" if args.grown else "")
    out = [BEGIN, "## Load-generator suite (`scripts/bench_suite.py`)", "",
           f"Regenerated by `python scripts/bench_suite.py{flags}`, run on {started} in {wall_s / 60:.1f} minutes.",
           "", f"- Machine: {machine_line(notes)}.",
           f"- Model: {model_notes(args, first)}.",
           "- Every ratio compares targets run back to back in one invocation on the same seeded workload "
           "(same prompts, same output budgets, greedy); with repeats, targets alternate order, each figure is "
           "the median over repeats and each ratio is between two such medians (per-repeat ratios are in the "
           "JSON). Absolute tokens/s on this shared 2-core machine drift run to run; read the ratios.",
           "- mlx_lm.server gets float32 copies of the same weights (it keeps the stored float16, gmlx computes in "
           "float32 on CPU) and runs with the BLAS gmlx loads (`python -m workers.bench.mlx_lm_launch`, mlx-lm's own "
           "`main()` after the BLAS is loaded), so both sides do the same arithmetic on the same library. "
           "mlx-lm does not report acceptance; its column shows `-`.",
           "- Time to first token counts from the request's send (closed loop) or scheduled arrival (open loop). "
           "ITL is the gap between token-carrying chunks split over the chunk's tokens (mlx-lm's per-token events "
           "of one round are merged first). Transition counts are engine counter deltas over the run.",
           f"- JSON results (every stream's timings) and PNG plots are written under `{_shown_path(args.out_dir)}` "
           "(git-ignored): rerun the command above to get them.", ""]
    for name, res in all_results.items():
        out += [f"### {res['title']}", "", f"`{res['suite_command']}`", "",
                f"Workload: {report.workload_line(res)}. Ratios (`x base`) are to **{res['baseline']}**. "
                f"Wall {res['suite_wall_s']:.0f} s; load average {res['machine']['load_average_1m_at_start']:.1f} "
                f"at its start.", "",
                report.results_table(res), "", *report.formats_lines(res), ""]
        if res.get("model") and res["model"] != first.get("model"):
            out[-1:] = ["", f"Model for this benchmark: `{_shown_path(res['model']['path'])}` (weights sha1 "
                            f"{res['model']['weights_sha1']}).", ""]
        out += HEADLINES[name](res) + [""]
        if res.get("plots"):
            out += ["Plots: " + ", ".join(f"`{_shown_path(p)}`" for p in res["plots"]), ""]
        elif res.get("plots_skipped"):
            out += [f"Plots: {res['plots_skipped']}.", ""]
    out.append(END)
    return "\n".join(out)


def _shown_path(path: str) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def write_section(path: Path, section: str) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + section + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer requests and repeats")
    p.add_argument("--only", default=None, help="comma list of: vs-mlx-lm, sweep, poisson, scripted "
                                                "(and vs-mlx-lm-grown with --grown)")
    p.add_argument("--model", default=None, help="target folder (default: the built-in model)")
    p.add_argument("--draft", default=None, help="draft model folder (with --model)")
    p.add_argument("--mtp", default=None, help="MTP head folder (with --model)")
    p.add_argument("--rate", type=float, default=6.0, help="Poisson arrivals per second")
    p.add_argument("--grown", default=None, metavar="INTERMEDIATE,EXTRA_LAYERS",
                   help="also compare with mlx-lm on the built-in model grown with inert parameters")
    p.add_argument("--out-dir", type=Path, default=REPO_ROOT / "runs" / "bench")
    p.add_argument("--benchmarks-md", type=Path, default=REPO_ROOT / "BENCHMARKS.md")
    p.add_argument("--no-write", action="store_true", help="print the section instead of writing it")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per benchmark")
    p.add_argument("--from-json", type=Path, default=None,
                   help="rewrite the section from a saved suite.json instead of running")
    args = p.parse_args()
    if args.model and not (args.draft and args.mtp):
        p.error("--model needs --draft and --mtp")
    if args.grown and args.model:
        p.error("--grown grows the built-in model; leave out --model")
    table, common = scenarios(args)
    names = args.only.split(",") if args.only else list(table)
    unknown = set(names) - set(table)
    if unknown:
        p.error(f"--only: unknown {sorted(unknown)}; choose from {', '.join(table)}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
        all_results = saved.get("results", saved)
        for name, res in all_results.items():  # tables and plots again, from the saved runs
            names = [t["name"] for t in res["targets"]]
            res["table"] = make_table(res["runs"], names, res["workload"]["concurrency_levels"], res["baseline"])
            written, res["plots_skipped"] = make_plots(res, args.out_dir / "plots" / name)
            res["plots"] = [str(p) for p in written]
        wall_s = saved.get("wall_s") or sum(r["suite_wall_s"] for r in all_results.values())
    else:
        start_s = time.perf_counter()
        all_results = {}
        for name in names:
            res = run_scenario(name, table[name], common, args.out_dir, args.timeout_s)
            res["title"] = table[name]["title"]
            all_results[name] = res
        wall_s = time.perf_counter() - start_s
        (args.out_dir / "suite.json").write_text(json.dumps({"wall_s": wall_s, "results": all_results}, indent=1))
    section = make_section(all_results, args, wall_s)
    if args.no_write:
        print(section)
    else:
        write_section(args.benchmarks_md, section)
        print(f"wrote the bench_suite section of {args.benchmarks_md} ({wall_s / 60:.1f} min)", file=sys.stderr)


if __name__ == "__main__":
    main()
