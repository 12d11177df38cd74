"""How much a long arrival stalls a running stream: its inter-token gaps around the arrival.

One stream decodes alone; after a warm-up a long prompt arrives and is prefilled beside it.
Reports the running stream's median inter-token gap over the 40 tokens before the arrival and
its worst gap from the arrival until four tokens after the newcomer joined (the join included),
and the arrival's own time to first token, for fixed 256-token chunks and for a time budget
per round (EngineConfig.prefill_budget_s, serve --prefill-budget-ms), each with the chunks in
forwards of their own and packed into the running rows' forwards (models/packed.py), side by
side in one run.

    python scripts/bench_prefill_gap.py                       # 1,500-token arrival, built-in model
    python scripts/bench_prefill_gap.py --prompt-tokens 3000 --drafter mtp
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO_ROOT))

from gmlx.platform.blas import ensure_fast_blas  # noqa: E402

ensure_fast_blas()  # the fast BLAS before mlx is first imported
from gmlx.config import EngineConfig  # noqa: E402
from gmlx.drafters import make_drafter  # noqa: E402
from gmlx.engine import Engine  # noqa: E402
from gmlx.models.loader import load_model  # noqa: E402
from gmlx.request import SamplingParams  # noqa: E402


def measure(target, drafter_kind: str, budget_s: float | None, is_packed: bool, prompt_tokens: int,
            warmup_steps: int) -> dict:
    config = EngineConfig(prefill_budget_s=budget_s, is_prefill_packed=is_packed,
                          max_context_tokens=prompt_tokens + 512)
    engine = Engine(target, make_drafter(drafter_kind, target), config)
    text = Path(statistics.__file__).read_text()
    tokens = target.tokenizer.encode(text)
    engine.add_request(tokens[:16], SamplingParams(max_tokens=100_000), request_id="running")
    stamps, cpu_stamps, arrival_step, joined_step, arrival_s, first_token_s = [], [], None, None, None, None
    for step in range(100_000):
        if step == warmup_steps:
            engine.add_request(tokens[100:100 + prompt_tokens], SamplingParams(max_tokens=8), request_id="long")
            arrival_step, arrival_s = len(stamps), time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        if any(o.request_id == "running" and o.new_token_ids for o in outputs):
            stamps.append(now)
            cpu_stamps.append(time.process_time())
        if joined_step is None and any(o.request_id == "long" and o.new_token_ids for o in outputs):
            joined_step, first_token_s = len(stamps), now
        if joined_step is not None and len(stamps) > joined_step + 4:
            break
    result = {"num_gaps_during": joined_step + 2 - arrival_step, "ttft_ms": (first_token_s - arrival_s) * 1000}
    # CPU time per gap as well: on a shared box the wall gaps also hold other processes' turns.
    for prefix, times in (("", stamps), ("cpu_", cpu_stamps)):
        gaps = [b - a for a, b in zip(times, times[1:])]
        result[prefix + "median_ms"] = statistics.median(gaps[max(0, arrival_step - 40):arrival_step - 1]) * 1000
        result[prefix + "worst_ms"] = max(gaps[arrival_step - 1:joined_step + 1]) * 1000
    return result


def measure_alone(target, num_steps: int) -> dict:
    """The same stream with nobody arriving, num_steps gaps: the box's own jitter, for scale."""
    engine = Engine(target, None, EngineConfig(max_context_tokens=num_steps + 600))
    tokens = target.tokenizer.encode(Path(statistics.__file__).read_text())
    engine.add_request(tokens[:16], SamplingParams(max_tokens=100_000), request_id="running")
    for _ in range(20):
        engine.step()
    stamps, cpu_stamps = [], []
    for _ in range(num_steps + 1):
        engine.step()
        stamps.append(time.perf_counter())
        cpu_stamps.append(time.process_time())
    result = {}
    for prefix, times in (("", stamps), ("cpu_", cpu_stamps)):
        gaps = [b - a for a, b in zip(times, times[1:])]
        result[prefix + "median_ms"], result[prefix + "worst_ms"] = statistics.median(gaps) * 1000, max(gaps) * 1000
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--drafter", default="none")
    parser.add_argument("--warmup-steps", type=int, default=60)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    target = load_model(args.model)
    print(f"{args.model or 'built-in model'}, drafter {args.drafter}, load average {os.getloadavg()[0]:.1f}")
    print("| prefill | arrival tokens | median gap before ms | worst gap until joined ms | worst / median | "
          "CPU ms: median / worst gap | CPU worst / median | arrival's first token ms |")
    print("|---|---|---|---|---|---|---|---|")
    runs = (("fixed 256-token chunks, own forward", 0, False), ("fixed 256-token chunks, packed", 0, True),
            ("time budget auto, own forward (2x round)", None, False),
            ("time budget auto, packed (0.5x round)", None, True))
    num_gaps = 0
    for name, budget_s, is_packed in runs:
        r = measure(target, args.drafter, budget_s, is_packed, args.prompt_tokens, args.warmup_steps)
        num_gaps = max(num_gaps, r["num_gaps_during"])
        print(f"| {name} | {args.prompt_tokens} | {r['median_ms']:.1f} | {r['worst_ms']:.1f} | "
              f"{r['worst_ms'] / r['median_ms']:.2f} ({r['num_gaps_during']} gaps) | "
              f"{r['cpu_median_ms']:.1f} / {r['cpu_worst_ms']:.1f} | {r['cpu_worst_ms'] / r['cpu_median_ms']:.2f} | "
              f"{r['ttft_ms']:.0f} |")
    r = measure_alone(target, num_gaps)
    print(f"| nobody arrives (the stream alone, as many gaps) | 0 | {r['median_ms']:.1f} | {r['worst_ms']:.1f} | "
          f"{r['worst_ms'] / r['median_ms']:.2f} ({num_gaps} gaps) | {r['cpu_median_ms']:.1f} / "
          f"{r['cpu_worst_ms']:.1f} | {r['cpu_worst_ms'] / r['cpu_median_ms']:.2f} | - |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
