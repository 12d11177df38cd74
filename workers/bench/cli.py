"""`gmlx bench`: run a load against one or more targets side by side; print a table, write JSON.

workers/cli.py registers it with `main.add_command(bench)`; `python -m workers.bench.cli` runs it
standalone.
"""

from __future__ import annotations

import json
import logging
import shlex
import sys
from pathlib import Path

import click

from workers.bench.workload import LOAD_KINDS, PROMPT_SOURCES, Lengths, WorkloadOptions

logger = logging.getLogger(__name__)


def _check_lengths(ctx, param, value):
    try:
        Lengths.parse(value, param.name)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    return value


def _parse_levels(ctx, param, value):
    try:
        levels = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected N or a comma list like 1,2,4,8") from None
    if not levels or any(n <= 0 for n in levels):
        raise click.BadParameter(f"{value!r}: every level must be > 0")
    return levels


@click.command("bench", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--target", "targets", multiple=True, default=("engine",), show_default=True,
              help="KIND[:key=value,...]; KIND is engine, server, mlx-lm or llama-server; keys: drafter, model, "
                   "preempt, resume, adaptive, evidence, amx (0|1: GMLX_CPU_AMX), kv, kv_mb, kv_reserve, width_cap, "
                   "num_draft_tokens, "
                   "row_invariance (0|1, at load), row_attention (masked|unmasked, at load), address, blas, "
                   "format (mlx-lm: auto|float32|quantized), gguf, np, ctx, repack (llama-server: the GGUF, slots, "
                   "context per slot, 0 for --no-repack), label. Repeat to compare side by side.")
@click.option("--model", default=None,
              help="Model for every target: a folder, a .gguf file or smollm2 (default: the built-in model).")
@click.option("--drafter", default=None, help="Drafter for targets that name none: none|mtp|draft[:PATH]|ngram.")
@click.option("--preempt/--no-preempt", default=None, help="GMLX_MTP_PREEMPT for gmlx targets that name none.")
@click.option("--resume/--no-resume", default=None, help="GMLX_MTP_RESUME for gmlx targets that name none.")
@click.option("--width-cap", type=click.IntRange(min=0), default=None, help="GMLX_MTP_WIDTH_CAP (0 = uncapped).")
@click.option("--num-draft-tokens", type=click.IntRange(min=1), default=None, help="Draft depth k.")
@click.option("--load", "load_kind", type=click.Choice(LOAD_KINDS), default="closed", show_default=True,
              help="closed: N clients back to back; poisson: arrivals at --rate; burst: --burst-size every "
                   "--burst-interval-s; scripted: one long stream, then arrivals while it decodes.")
@click.option("--concurrency", default="8", show_default=True, callback=_parse_levels,
              help="Closed loop: clients in flight; a comma list (1,2,4,8) sweeps.")
@click.option("--num-requests", type=click.IntRange(min=1), default=None,
              help="Requests per run [default: 2 per client for closed loop, else 16].")
@click.option("--requests-per-client", type=click.IntRange(min=1), default=None,
              help="Closed loop: requests per client and run, at every --concurrency level [default: 2]; "
                   "longer runs average out a shared machine's noise.")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=2.0, show_default=True,
              help="Poisson arrivals per second.")
@click.option("--burst-size", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--burst-interval-s", type=click.FloatRange(min=0), default=2.0, show_default=True)
@click.option("--long-max-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="Scripted: the lone stream's budget.")
@click.option("--arrival-delay-s", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="Scripted: when the first arrival comes.")
@click.option("--arrival-interval-s", type=click.FloatRange(min=0), default=0.25, show_default=True,
              help="Scripted: the gap between arrivals.")
@click.option("--prompt-source", type=click.Choice(PROMPT_SOURCES), default="heldout", show_default=True,
              help="heldout: slices of stdlib files the built-in model never trained on; random: random tokens.")
@click.option("--prompt-tokens", default="uniform:32,96", show_default=True, callback=_check_lengths,
              help="Prompt length: N, uniform:A,B or lognormal:MEDIAN,SIGMA[,MAX].")
@click.option("--max-tokens", default="64", show_default=True, callback=_check_lengths,
              help="Output budget per request, same forms as --prompt-tokens.")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True)
@click.option("--ignore-eos", is_flag=True,
              help="Fixed-length answers: every request decodes its whole --max-tokens (EOS ends nothing), on gmlx "
                   "and llama-server targets; mlx_lm.server cannot, so an mlx-lm target refuses it.")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="Runs per target and level; ratios are medians of per-repeat ratios.")
@click.option("--restart-per-repeat", is_flag=True,
              help="Start every target afresh for each repeat (repeats outermost): a process's own speed, "
                   "which can differ from an identical one's by ~8%, then averages out over repeats.")
@click.option("--warmup/--no-warmup", default=True, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--timeout-s", type=click.FloatRange(min=1), default=600.0, show_default=True,
              help="Per run: requests still going after this are cancelled and counted as errors.")
@click.option("--baseline", default=None, help="Target name the ratios divide by [default: the first target].")
@click.option("--best-of", "best_of", default=None,
              help="Comma list of targets: every other target's aggregate tok/s over the best of them, as the "
                   "best median and cross-fitted (the best chosen on half the repeats, read on the other half).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write results JSON here.")
@click.option("--plots", "plots_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write PNG plots here (needs matplotlib; skipped with a note without it).")
@click.option("--json", "as_json", is_flag=True, help="Print the results JSON as the last line of stdout.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def bench(targets, model, drafter, preempt, resume, width_cap, num_draft_tokens, load_kind, concurrency,
          num_requests, requests_per_client, rate, burst_size, burst_interval_s, long_max_tokens, arrival_delay_s,
          arrival_interval_s, prompt_source, prompt_tokens, max_tokens, temperature, ignore_eos, repeats,
          restart_per_repeat, warmup, seed, timeout_s, baseline, best_of, out, plots_dir, as_json, quiet) -> None:
    """Benchmark gmlx (in-process engine or server), mlx_lm.server and llama.cpp's llama-server under the
    same load.

    \b
    Targets (--target KIND[:key=value,...], repeat to compare side by side in one run):
      engine        the in-process engine; with no drafter= key (and no --drafter) EngineConfig's
                    default drafter: none (decodes plain)
      server        a `gmlx serve` process; with no drafter= key gmlx serve's default, ngram
      mlx-lm        mlx_lm.server on loopback; a GGUF is converted once (gmlx convert) and copied
                    in the format gmlx computes in here (format=auto|float32|quantized)
      llama-server  llama.cpp's llama-server -np N (build: bash scripts/build_llama_cpp.sh;
                    LLAMA_CPP_CACHE overrides its folder) on the model's GGUF or gguf=PATH,
                    np=N (default: the concurrency), ctx=N tokens per slot, threads = the cores,
                    repack=0 for --no-repack (where llama-server dies at start with its AMX layouts)

    \b
    For example, SmolLM2 on three servers with 8 clients:
      gmlx bench --model smollm2 --concurrency 8 --num-requests 24 --max-tokens 64 \\
        --target server:drafter=none --target mlx-lm:drafter=none --target llama-server
    """
    from workers.bench.best_of import versus_best, versus_best_table
    from workers.bench.report import formats_lines, results_table
    from workers.bench.runner import run_benchmark
    from workers.bench.targets import parse_target

    defaults = dict(model=model, drafter=drafter, preempt=preempt, resume=resume, width_cap=width_cap,
                    num_draft_tokens=num_draft_tokens)
    specs = []
    for text in targets:
        kind = text.partition(":")[0]
        own_keys = {"mlx-lm": ("model", "drafter", "num_draft_tokens"), "llama-server": ("model",)}.get(kind)
        own = {k: v for k, v in defaults.items() if own_keys is None or k in own_keys}
        try:
            specs.append(parse_target(text, own))
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--target") from None
    if ignore_eos and any(s.kind == "mlx-lm" for s in specs):
        raise click.BadParameter("mlx_lm.server has no way to ignore EOS: its answers would be shorter than the "
                                 "others'; drop --ignore-eos or the mlx-lm target", param_hint="--ignore-eos")
    comparators = _comparators(best_of, [s.name for s in specs])
    options = WorkloadOptions(
        kind=load_kind, num_requests=num_requests or 16, concurrency=concurrency[0],
        requests_per_client=None if num_requests or load_kind != "closed" else requests_per_client or 2,
        rate_per_s=rate,
        burst_size=burst_size, burst_interval_s=burst_interval_s, long_max_tokens=long_max_tokens,
        arrival_delay_s=arrival_delay_s, arrival_interval_s=arrival_interval_s, prompt_source=prompt_source,
        prompt_tokens=prompt_tokens, max_tokens=max_tokens, temperature=temperature, seed=seed,
        is_ignore_eos=ignore_eos)
    command = "gmlx bench " + " ".join(shlex.quote(a) for a in sys.argv[_first_arg_index():])
    try:
        results = run_benchmark(options, specs, concurrencies=concurrency, repeats=repeats, is_warmup=warmup,
                                timeout_s=timeout_s, is_progress=not quiet, baseline=baseline, command=command,
                                restart_per_repeat=restart_per_repeat)
    except (ValueError, RuntimeError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    if comparators:
        results["versus_best"] = versus_best(results["runs"], comparators)
    if plots_dir is not None:
        from workers.bench.plots import make_plots

        written, skipped = make_plots(results, plots_dir)
        results["plots"] = [str(p) for p in written]
        results["plots_skipped"] = skipped
        click.echo(skipped or "plots: " + ", ".join(str(p) for p in written), err=True)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))
        click.echo(f"results: {out}", err=True)
    if as_json:
        click.echo(json.dumps(results))
    else:
        click.echo(results_table(results))
        click.echo("\n".join(formats_lines(results)))
        if comparators:
            click.echo(versus_best_table(results["versus_best"]))


def _comparators(text: str | None, names: list[str]) -> list[str]:
    """--best-of's targets, each one of the run's, leaving at least one target to compare."""
    if text is None:
        return []
    comparators = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in comparators if c not in names]
    if not comparators or unknown:
        raise click.BadParameter(f"{text!r}: name targets of this run ({', '.join(names)})", param_hint="--best-of")
    if set(names) <= set(comparators):
        raise click.BadParameter(f"{text!r} names every target: leave one to compare", param_hint="--best-of")
    return comparators


def _first_arg_index() -> int:
    """Where bench's own arguments start in sys.argv (after `gmlx bench` or `-m workers.bench.cli`)."""
    return sys.argv.index("bench") + 1 if "bench" in sys.argv[1:2] else 1


def _main() -> None:
    from gmlx import config

    logging.basicConfig(level=config.log_level(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    bench()


if __name__ == "__main__":
    _main()
