"""Transitions: preempt on/off, resume on/off, and the prompt cache, side by side in one run.

    python scripts/bench_transitions.py                   # built-in target, MTP drafter
    python scripts/bench_transitions.py --model inert     # the inert-grown target (labelled)

two_stream  A speculates alone; B arrives after A's first `--a-lead` tokens.
            B's time to first token and the aggregate tokens/s from B's arrival to the
            end, preempt on vs off.
resume      3 rows over a cap of 2 until the short one leaves; tokens/s of the two
            surviving rows after the drain, resume on vs off.
prompt      a long prompt cold, then again: time to first token, cached vs cold.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from gmlx.platform.blas import ensure_fast_blas  # noqa: E402

ensure_fast_blas()  # the fast BLAS before mlx is first imported

from ab import median_ratio_of  # noqa: E402
from bench_models import forward_ms, grow_inert, heldout_prompts  # noqa: E402
from gmlx.config import BUILTIN_MTP_DIR, EngineConfig  # noqa: E402
from gmlx.drafters import make_drafter  # noqa: E402
from gmlx.engine import Engine  # noqa: E402
from gmlx.models.loader import load_model  # noqa: E402
from gmlx.request import SamplingParams  # noqa: E402


def with_env(**values):
    for key, value in values.items():
        os.environ[key] = str(value)


def two_stream(target, drafter_spec, prompts, a_tokens, b_tokens, a_lead, is_preempt_on):
    with_env(GMLX_MTP_PREEMPT=int(is_preempt_on))
    engine = Engine(target, make_drafter(drafter_spec, target), EngineConfig(prompt_cache_bytes=0))
    engine.add_request(prompts[0], SamplingParams(max_tokens=a_tokens), request_id="A")
    emitted = {"A": 0, "B": 0}
    b_added_s = b_first_s = None
    count_after_b = 0
    while engine.has_unfinished() or b_added_s is None:
        if b_added_s is None and emitted["A"] >= a_lead:
            engine.add_request(prompts[1], SamplingParams(max_tokens=b_tokens), request_id="B")
            b_added_s = time.perf_counter()
        for out in engine.step():
            emitted[out.request_id] += len(out.new_token_ids)
            if b_added_s is not None:
                count_after_b += len(out.new_token_ids)
            if out.request_id == "B" and b_first_s is None and out.new_token_ids:
                b_first_s = time.perf_counter()
    end_s = time.perf_counter()
    return dict(b_ttft_s=b_first_s - b_added_s, aggregate_tok_s=count_after_b / (end_s - b_added_s),
                num_preempts=engine.counters["num_preempts"])


def resume(target, drafter_spec, prompts, is_resume_on, tokens):
    with_env(GMLX_MTP_RESUME=int(is_resume_on), GMLX_MTP_WIDTH_CAP=2, GMLX_RESUME_MIN_BUDGET=8)
    engine = Engine(target, make_drafter(drafter_spec, target), EngineConfig(prompt_cache_bytes=0,
                                                                            prefill_chunk_tokens=4096))
    short = engine.add_request(prompts[2], SamplingParams(max_tokens=8))
    for p in prompts[:2]:
        engine.add_request(p, SamplingParams(max_tokens=tokens))
    drained_s, count = None, 0
    while engine.has_unfinished():
        outs = engine.step()
        if drained_s is not None:
            count += sum(len(o.new_token_ids) for o in outs)
        if any(o.request_id == short and o.finish_reason for o in outs):
            drained_s = time.perf_counter()
    for key in ("GMLX_MTP_RESUME", "GMLX_MTP_WIDTH_CAP", "GMLX_RESUME_MIN_BUDGET"):
        del os.environ[key]
    return dict(after_drain_tok_s=count / (time.perf_counter() - drained_s),
                num_resumes=engine.counters["num_resumes"])


def prompt_cache(target, prompt):
    engine = Engine(target, None, EngineConfig())
    ttfts = []
    for _ in range(2):
        engine.add_request(prompt, SamplingParams(max_tokens=1))
        stats = None
        while engine.has_unfinished():
            for out in engine.step():
                stats = out.stats or stats
        ttfts.append(stats["ttft_s"])
    return dict(prompt_tokens=len(prompt), cold_ttft_s=ttfts[0], cached_ttft_s=ttfts[1], ratio=ttfts[1] / ttfts[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin", help="builtin or inert")
    parser.add_argument("--drafter", default="mtp")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--a-tokens", type=int, default=256)
    parser.add_argument("--b-tokens", type=int, default=64)
    parser.add_argument("--a-lead", type=int, default=32)
    parser.add_argument("--inert-dir", default=str(Path(tempfile.gettempdir()) / "gmlx-bench-inert"))
    args = parser.parse_args()
    folder, spec = None, args.drafter
    if args.model == "inert":
        folder = grow_inert(Path(args.inert_dir), 8192, 12)
        spec = f"mtp:{BUILTIN_MTP_DIR}" if args.drafter == "mtp" else args.drafter
    target = load_model(folder)
    prompts = heldout_prompts(target.tokenizer, 4, 64)
    label = f"{args.model} ({forward_ms(target):.1f} ms/forward), drafter {args.drafter}"
    runs = {"on": [], "off": []}
    resumes = {"on": [], "off": []}
    for _ in range(args.repeats):
        for state in ("on", "off"):
            runs[state].append(two_stream(target, spec, prompts, args.a_tokens, args.b_tokens, args.a_lead, state == "on"))
            resumes[state].append(resume(target, spec, prompts, state == "on", args.a_tokens // 2))
    os.environ.pop("GMLX_MTP_PREEMPT", None)
    ratio = lambda rows, key: median_ratio_of(rows["on"], rows["off"], key)  # noqa: E731
    long_prompt = heldout_prompts(target.tokenizer, 1, min(900, target.max_context_tokens - 8))[0]
    report = {
        "model": label,
        "two_stream": {"b_ttft_on_over_off": ratio(runs, "b_ttft_s"),
                       "aggregate_tok_s_on_over_off": ratio(runs, "aggregate_tok_s"),
                       "on": runs["on"], "off": runs["off"]},
        "resume": {"after_drain_tok_s_on_over_off": ratio(resumes, "after_drain_tok_s"),
                   "on": resumes["on"], "off": resumes["off"]},
        "prompt_cache": prompt_cache(target, long_prompt),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
