"""Run many randomized schedules against solo plain decoding (the CI suite runs ~750).

Every stream must equal its solo plain decoding token for token (greedy and seeded
sampling), with random arrivals, budgets, caps, cancels, and preempt/resume on and off.

    python scripts/fuzz_schedules.py --num 10000                 # every drafter, round robin
    python scripts/fuzz_schedules.py --num 2000 --drafters mtp --start 123
    python scripts/fuzz_schedules.py --num 1000 --logprobs-rate 0.5   # logprobs too, bit for bit
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/schedules.py

from gmlx.platform.blas import ensure_fast_blas  # noqa: E402

ensure_fast_blas()  # the fast BLAS before mlx is first imported
from gmlx.config import EngineConfig  # noqa: E402
from gmlx.drafters import make_drafter  # noqa: E402
from gmlx.engine import Engine  # noqa: E402
from gmlx.models.loader import load_model  # noqa: E402
from schedules import SoloReference, check_schedule, make_schedule  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num", type=int, default=10_000)
    parser.add_argument("--start", type=int, default=0, help="first schedule seed")
    parser.add_argument("--drafters", default="mtp,draft,ngram")
    parser.add_argument("--model", default=None)
    parser.add_argument("--logprobs-rate", type=float, default=0.0,
                        help="share of requests asking for logprobs (and some for prompt logprobs)")
    parser.add_argument("--penalty-rate", type=float, default=0.0, help="share of requests penalizing repeats")
    parser.add_argument("--bias-rate", type=float, default=0.0, help="share of requests with a logit_bias")
    parser.add_argument("--end-rate", type=float, default=0.0,
                        help="share of requests with stop_token_ids, min_tokens or ignore_eos")
    args = parser.parse_args()
    target = load_model(args.model)
    reference = SoloReference(target)
    kinds = args.drafters.split(",")
    engines = {k: Engine(target, make_drafter(k, target), EngineConfig(prefill_chunk_tokens=64)) for k in kinds}
    source = Path(random.__file__).read_text()
    tokens = target.tokenizer.encode(source)
    pool = [tokens[i : i + 120] for i in range(0, len(tokens) - 120, 997)]
    totals, failures, start_s = {}, [], time.perf_counter()
    for n in range(args.num):
        seed = args.start + n
        kind = kinds[n % len(kinds)]
        schedule = make_schedule(seed, target.vocab_size, pool, max_requests=8, caps=(0, 1, 2, 3, 4),
                                 logprobs_rate=args.logprobs_rate, penalty_rate=args.penalty_rate,
                                 bias_rate=args.bias_rate, end_rate=args.end_rate,
                                 eos_token_id=min(target.eos_token_ids))
        try:
            result = check_schedule(engines[kind], reference, schedule)
        except AssertionError as exc:
            failures.append((seed, kind, str(exc)))
            print(f"FAIL seed={seed} drafter={kind}: {exc}", flush=True)
            continue
        for key, value in result.counters.items():
            totals[key] = totals.get(key, 0) + value
        if (n + 1) % 100 == 0:
            rate = (n + 1) / (time.perf_counter() - start_s)
            print(f"{n + 1}/{args.num} schedules, {len(failures)} failures, {rate:.1f}/s", file=sys.stderr, flush=True)
    print({k: v for k, v in totals.items() if v})
    print(f"{args.num - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
