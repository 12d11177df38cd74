"""The load generator, run for real against the in-process engine with a tiny load."""

import json
import os
import random

import pytest

from workers.bench import WorkloadOptions, parse_target, run_benchmark
from workers.bench.best_of import versus_best, versus_best_table
from workers.bench.metrics import StreamRecord, percentile, summarize
from workers.bench.report import paired, paired_range, results_table, workload_line
from workers.bench.workload import Lengths, heldout_files, poisson_arrivals

TINY = dict(prompt_tokens="uniform:8,24", max_tokens="8", seed=3)


def run_engine(options: WorkloadOptions, *targets: str) -> dict:
    results = run_benchmark(options, [parse_target(t) for t in targets], is_warmup=False, is_progress=False,
                            timeout_s=120.0)
    return json.loads(json.dumps(results))  # the document must be plain JSON


def test_closed_loop_against_engine_reports_every_metric():
    results = run_engine(WorkloadOptions(kind="closed", num_requests=4, concurrency=2, **TINY), "engine:drafter=mtp")
    (run,) = results["runs"]
    s = run["summary"]
    assert s["num_requests"] == s["num_completed"] == 4 and s["num_errors"] == 0
    for key in ("ttft_s", "itl_s", "stream_tok_per_s", "e2e_s"):
        for q in ("p50", "p95", "p99"):
            assert s[key][q] is not None and s[key][q] > 0, (key, q)
        assert s[key]["p50"] <= s[key]["p95"] <= s[key]["p99"]
    assert 0 < s["num_output_tokens"] <= 4 * 8
    assert s["aggregate_tok_per_s"] == pytest.approx(s["num_output_tokens"] / s["duration_s"])
    # Every stream's tokens, as timed by the load generator, match what the engine says it generated.
    for stream in run["streams"]:
        assert sum(stream["chunk_tokens"]) == stream["stats"]["generated_tokens"]
        assert stream["chunk_times_s"] == sorted(stream["chunk_times_s"])
        assert stream["chunk_times_s"][0] >= stream["arrival_s"]
    assert s["num_drafted"] > 0 and 0.0 <= s["acceptance_rate"] <= 1.0
    assert s["num_drafted"] == run["counters"]["num_drafted"]
    assert {"num_preempts", "num_resumes", "num_capture_rounds", "num_gated_rounds"} <= set(s["transitions"])
    # The depth policy's ledger (over the engine's life, warm-up included) holds this run's kept drafts.
    (policy,) = run["draft_depth"]
    assert sum(kept for _, _, kept in policy["kept_vs_expected"].values()) >= s["num_accepted"]
    (row,) = results["table"]
    assert row["vs_baseline"]["aggregate_tok_per_s"] == pytest.approx(1.0)
    assert paired(row, "aggregate_tok_per_s") == pytest.approx(1.0)
    header, _, line = results_table(results).splitlines()
    # One repeat: no range across repeats to show.
    assert "| x base | x base paired | repeats' range |" in header and "| 1.00x | 1.00x | - |" in line
    assert results["machine"]["logical_cores"] >= 1


def test_ignore_eos_reaches_every_target_that_can_and_mlx_lm_refuses_it():
    """--ignore-eos (fixed-length answers, as vLLM's benchmark sends them): gmlx's targets get it
    as ignore_eos, llama-server's body carries it, and the mlx-lm target, which has no such
    option, is refused rather than compared on shorter answers."""
    from click.testing import CliRunner

    from workers.bench.cli import bench
    from workers.bench.llama_server import completion_body
    from workers.bench.workload import RequestSpec, Workload

    spec = RequestSpec(3, "x", 12, None, "main")
    for is_ignore_eos in (False, True):
        workload = Workload("closed", (spec,), 1, 0.0, {}, is_ignore_eos)
        assert json.loads(completion_body([1, 2], spec, workload))["ignore_eos"] is is_ignore_eos
        assert workload.describe()["ignore_eos"] is is_ignore_eos
    results = run_engine(WorkloadOptions(kind="closed", num_requests=2, concurrency=2, is_ignore_eos=True, **TINY),
                         "engine")
    assert results["workload"]["ignore_eos"] is True and "EOS ignored" in workload_line(results)
    done = CliRunner().invoke(bench, ["--target", "mlx-lm", "--ignore-eos"])
    assert done.exit_code != 0 and "--ignore-eos" in done.output


def test_scripted_arrivals_preempt_the_lone_stream_only_when_preempt_is_on():
    options = WorkloadOptions(kind="scripted", num_requests=3, long_max_tokens=160, arrival_delay_s=0.05,
                              arrival_interval_s=0.02, **TINY)
    # Fixed depth: the lone stream keeps speculating (a depth-gated one is a batch that admits).
    results = run_engine(options, "engine:drafter=mtp,adaptive=0,label=on",
                         "engine:drafter=mtp,adaptive=0,preempt=0,label=off")
    on, off = (next(r for r in results["runs"] if r["target"] == name) for name in ("on", "off"))
    assert on["counters"]["num_preempts"] >= 1
    assert any(e["kind"] == "preempt" for e in on["events"])
    assert off["counters"]["num_preempts"] == 0
    assert [s["group"] for s in on["streams"]] == ["long", "arrival", "arrival"]
    assert on["streams"][0]["stats"]["is_preempted"] and not off["streams"][0]["stats"]["is_preempted"]
    # Without preempt the arrivals wait for the lone stream to finish.
    long_finish_s = off["streams"][0]["finish_s"]
    assert all(s["chunk_times_s"][0] >= long_finish_s - 1e-6 for s in off["streams"][1:])
    assert on["summary"]["groups"]["arrival"]["ttft_s"]["p95"] is not None


def test_metrics_on_hand_made_records():
    a = StreamRecord(0, "main", 8, arrival_s=0.0)
    for t, n in ((0.5, 1), (0.7, 2), (1.0, 3)):
        a.add_chunk(t, n)
    a.finish(1.0, "length")
    b = StreamRecord(1, "main", 8, arrival_s=0.2)
    b.finish(0.3, "error", "boom")
    s = summarize([a, b])
    assert s["ttft_s"]["p50"] == pytest.approx(0.5)
    assert a.token_gaps_s() == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.1])
    assert a.decode_tok_per_s == pytest.approx(5 / 0.5)
    assert s["num_output_tokens"] == 6 and s["num_errors"] == 1 and s["num_completed"] == 1
    assert s["aggregate_tok_per_s"] == pytest.approx(6 / 1.0)
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5) and percentile([], 50) is None


def test_paired_ratio_is_the_median_of_each_repeats_own_ratio():
    # Ratios of medians and paired ratios differ when the box's speed moves between repeats.
    row = {"vs_baseline_per_repeat": {"aggregate_tok_per_s": [1.3, None, 0.8, 0.95]}}
    assert paired(row, "aggregate_tok_per_s") == pytest.approx(0.95)
    row["vs_baseline_per_repeat"]["aggregate_tok_per_s"].append(1.05)
    assert paired(row, "aggregate_tok_per_s") == pytest.approx(1.0)
    assert paired({"vs_baseline_per_repeat": {"aggregate_tok_per_s": [None]}}, "aggregate_tok_per_s") is None
    assert paired({}, "aggregate_tok_per_s") is None
    assert paired_range(row, "aggregate_tok_per_s") == (0.8, 1.3)
    assert paired_range({"vs_baseline_per_repeat": {"aggregate_tok_per_s": [0.9, None]}}, "aggregate_tok_per_s") is None


def _runs(values: dict, level=8) -> list[dict]:
    """Bench runs carrying only an aggregate tok/s: {target: [one value per repeat]}."""
    return [{"target": t, "level": level, "repeat": rep, "summary": {"aggregate_tok_per_s": v}}
            for t, series in values.items() for rep, v in enumerate(series)]


def test_best_of_reads_the_best_median_and_cross_fits_by_hand():
    runs = _runs({"subject": [90, 110], "a": [100, 100], "b": [80, 130]})
    (row,) = versus_best(runs, ["a", "b"])
    assert row["target"] == "subject" and row["num_repeats"] == 2
    assert row["of_medians"] == pytest.approx(100 / 105)  # b's median 105 beats a's 100
    # Chosen on repeat 0, a (100 > 80), read on repeat 1: 110 / 100; chosen on 1, b, read on 0: 90 / 80.
    assert row["cross_fitted"] == pytest.approx((110 / 100 + 90 / 80) / 2)
    assert versus_best(_runs({"subject": [90], "a": [100]}), ["a"])[0]["cross_fitted"] is None
    # Past 512 ways to halve the repeats (12 of them: 924), a seeded sample of the halvings.
    (many,) = versus_best(_runs({"subject": [1.0 + r / 100 for r in range(12)], "a": [1.0] * 12}), ["a"])
    assert many["num_repeats"] == 12 and many["cross_fitted"] == pytest.approx(1.055, abs=0.01)
    assert "| 8 | subject | 0.952 | 1.113 | 2 |" in versus_best_table([row])


def test_best_of_cross_fitting_takes_out_the_maximums_bias():
    # Four targets equally fast under 5% noise per repeat: the best of three medians beats the
    # fourth by ~2% on average; cross-fitted, the fourth reads level with them.
    rng = random.Random(18)
    of_medians, cross_fitted = [], []
    for sweep in range(300):
        values = {t: [rng.lognormvariate(0.0, 0.05) for _ in range(6)] for t in ("default", "p", "n", "m")}
        (row,) = versus_best(_runs(values, level=sweep), ["p", "n", "m"])
        of_medians.append(row["of_medians"])
        cross_fitted.append(row["cross_fitted"])
    assert sum(of_medians) / 300 < 0.985
    assert sum(cross_fitted) / 300 == pytest.approx(1.0, abs=0.008)


def test_best_of_names_targets_of_the_run():
    from click.testing import CliRunner

    from workers.bench.cli import bench

    for best_of, message in (("c", "name targets of this run"), ("a,b", "leave one to compare")):
        out = CliRunner().invoke(bench, ["--target", "engine:label=a", "--target", "engine:label=b",
                                         "--best-of", best_of])
        assert out.exit_code == 2 and message in out.output, out.output


def test_lengths_targets_and_arrivals_validate_and_sample():
    rng = random.Random(0)
    assert Lengths.parse("12").sample(rng) == 12
    assert all(3 <= Lengths.parse("uniform:3,5").sample(rng) <= 5 for _ in range(50))
    assert all(1 <= Lengths.parse("lognormal:40,1,100").sample(rng) <= 100 for _ in range(200))
    for bad in ("uniform:5,3", "gauss:1", "fixed:0", "lognormal:1"):
        with pytest.raises(ValueError):
            Lengths.parse(bad)
    times = poisson_arrivals(2000, 4.0, random.Random(1))
    assert times == sorted(times) and 2000 / times[-1] == pytest.approx(4.0, rel=0.1)
    spec = parse_target("server:drafter=mtp,preempt=0,width_cap=2", {"drafter": "none", "resume": True})
    assert (spec.drafter, spec.preempt, spec.resume, spec.width_cap) == ("mtp", False, True, 2)
    assert spec.gmlx_env() == {"GMLX_MTP_PREEMPT": "0", "GMLX_MTP_RESUME": "1", "GMLX_MTP_WIDTH_CAP": "2"}
    for bad in ("vllm", "server:bogus=1", "mlx-lm:drafter=mtp", "server:address=tcp://10.0.0.1:5555",
                "engine:preempt=yes"):
        with pytest.raises(ValueError):
            parse_target(bad)
    assert heldout_files(), "the held-out prompt files must exist"


def test_plots_are_written_from_results(tmp_path):
    pytest.importorskip("matplotlib")
    from workers.bench.plots import make_plots

    results = run_engine(WorkloadOptions(kind="closed", num_requests=2, concurrency=1, **TINY),
                         "engine:drafter=none")
    results["table"] += [dict(results["table"][0], level=2)]  # a second level: the sweep plot
    written, skipped = make_plots(results, tmp_path)
    assert skipped is None and len(written) == 2
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG" for p in written)


def test_requests_per_client_sizes_every_level_of_a_sweep():
    from click.testing import CliRunner

    from workers.bench.cli import bench

    args = ["--target", "engine:drafter=ngram", "--concurrency", "1,2", "--requests-per-client", "3",
            "--prompt-tokens", "8", "--max-tokens", "4", "--no-warmup", "--quiet", "--json"]
    result = CliRunner().invoke(bench, args)
    assert result.exit_code == 0, result.output
    results = json.loads(result.output.strip().splitlines()[-1])
    assert {run["level"]: run["summary"]["num_requests"] for run in results["runs"]} == {1: 3, 2: 6}
    assert all(isinstance(run["calibration"], list) for run in results["runs"])


def test_row_invariance_is_a_load_time_knob_of_gmlx_targets():
    """`engine:row_invariance=1` loads its model under the GPU rules (here on the CPU), side by side
    with a target that does not; mlx-lm takes no gmlx knob."""
    from workers.bench.engine_target import EngineTarget

    spec = parse_target("engine:drafter=none,row_invariance=1")
    assert spec.gmlx_env() == {"GMLX_ROW_INVARIANCE": "1"} and spec.name == "engine drafter=none row_invariance=1"
    with pytest.raises(ValueError, match="gmlx knobs"):
        parse_target("mlx-lm:row_invariance=0")
    rule = parse_target("engine:row_invariance=1,row_attention=unmasked")
    assert rule.gmlx_env()["GMLX_ROW_ATTENTION"] == "unmasked" and rule.name.endswith("row_attention=unmasked")
    with pytest.raises(ValueError, match="row_attention must be one of"):
        parse_target("engine:row_attention=sometimes")
    targets = {value: EngineTarget(parse_target(f"engine:drafter=none,row_invariance={value}")) for value in "10"}
    for value, target in targets.items():
        target.start()
        assert target.engine.target.model.model.layers[0].self_attn.is_row_invariant == (value == "1")
        target.stop()


def test_kv_budget_knobs_reach_a_gmlx_targets_engine():
    """`kv_mb` and `kv_reserve` set GMLX_KV_CACHE_MB and GMLX_KV_RESERVE_TOKENS for a gmlx target:
    its engine takes that budget and reservation; mlx-lm takes neither, and a budget of 0 is refused."""
    from workers.bench.engine_target import EngineTarget

    spec = parse_target("engine:drafter=none,kv_mb=3,kv_reserve=0")
    assert spec.gmlx_env() == {"GMLX_KV_CACHE_MB": "3", "GMLX_KV_RESERVE_TOKENS": "0"}
    assert spec.name == "engine drafter=none kv_mb=3 kv_reserve=0"
    with pytest.raises(ValueError, match="gmlx knobs"):
        parse_target("mlx-lm:kv_reserve=8")
    with pytest.raises(ValueError, match="kv_mb must be > 0"):
        parse_target("server:kv_mb=0")
    target = EngineTarget(spec)
    target.start()
    try:
        assert (target.engine.kv_budget.budget_bytes, target.engine.kv_budget.reserve_tokens) == (3 << 20, 0)
    finally:
        target.stop()


def test_amx_knob_switches_the_kernels_around_an_in_process_targets_run(monkeypatch):
    """`engine:amx=0` runs its steps with the kernels' AMX switch off (the extension reads
    GMLX_CPU_AMX once, at load) and puts the process's setting back after; a server target gets it
    as GMLX_CPU_AMX."""
    from gmlx.platform import cpu_kernels
    from workers.bench import model_files
    from workers.bench.engine_target import EngineTarget
    from workers.bench.progress import Progress
    from workers.bench.workload import make_workload

    if not cpu_kernels.is_built():
        pytest.skip("the CPU kernels are not built here")
    from gmlx.engine import Engine

    ext = cpu_kernels.extension()
    assert parse_target("server:amx=1").gmlx_env() == {"GMLX_CPU_AMX": "1"}
    target = EngineTarget(parse_target("engine:drafter=none,amx=0"))
    # Not through the environment at load: the extension's first load would make it every target's.
    load = Engine.load
    env_at_load = []
    monkeypatch.setattr(Engine, "load",
                        lambda *a, **k: env_at_load.append(os.environ.get("GMLX_CPU_AMX")) or load(*a, **k))
    target.start()
    assert env_at_load == [os.environ.get("GMLX_CPU_AMX")]
    settings_seen = []
    step = target.engine.step
    monkeypatch.setattr(target.engine, "step", lambda: settings_seen.append(ext.amx_setting()) or step())
    before = ext.amx_setting()
    options = WorkloadOptions(kind="closed", num_requests=2, concurrency=2, **TINY)
    workload = make_workload(options, model_files.mlx_lm_folder(None) / "tokenizer.json")
    result = target.run(workload, Progress(2, "amx=0", is_enabled=False), timeout_s=60.0)
    assert settings_seen and set(settings_seen) == {0}
    assert ext.amx_setting() == before and len(result["records"]) == 2
    target.stop()
