"""What asking for logprobs costs: decode tok/s with logprobs = N against none, side by side.

Runs alternate (ABBA) on one engine per model; the ratio is the median of per-rep ratios.

    python scripts/bench_logprobs.py                                  # built-in and SmolLM2
    python scripts/bench_logprobs.py --models smollm2 --widths 1,8 --logprobs 0,5,20 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from gmlx.platform.blas import ensure_fast_blas  # noqa: E402

ensure_fast_blas()  # the fast BLAS before mlx is first imported
from ab import alternate, median_ratio  # noqa: E402
from bench_models import decode_tok_per_s, heldout_text_prompts  # noqa: E402
from gmlx.config import EngineConfig  # noqa: E402
from gmlx.drafters import make_drafter  # noqa: E402
from gmlx.engine import Engine  # noqa: E402
from gmlx.models.loader import load_model  # noqa: E402
from gmlx.request import SamplingParams  # noqa: E402

OFF = "off"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="builtin,smollm2", help="builtin | smollm2 | a model path, comma-separated")
    parser.add_argument("--drafter", default="none", help="the engine's drafter (none: plain decoding)")
    parser.add_argument("--widths", default="1,8", help="requests decoding together")
    parser.add_argument("--logprobs", default="0,5,20", help="the N of each side against no logprobs")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    counts = [int(n) for n in args.logprobs.split(",")]
    print("| model | drafter | width | logprobs | tok/s without | tok/s with | with / without |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        target = load_model(None if name == "builtin" else name)
        drafter = None if args.drafter == "none" else make_drafter(args.drafter, target)
        engine = Engine(target, drafter, EngineConfig(prompt_cache_bytes=0))
        for width in (int(w) for w in args.widths.split(",")):
            prompts = heldout_text_prompts(target.tokenizer, "prose", width, 128)

            def run(mode: str) -> float:
                logprobs = None if mode == OFF else int(mode)
                params = SamplingParams(max_tokens=args.tokens, logprobs=logprobs)
                return decode_tok_per_s(engine, prompts, params)[0]

            modes = [OFF, *(str(n) for n in counts)]
            runs = alternate(modes, args.repeats, run)
            for n in counts:
                ratio = median_ratio(zip(runs[str(n)], runs[OFF]))
                print(f"| {name} | {args.drafter} | {width} | {n} | {statistics.median(runs[OFF]):.1f} | "
                      f"{statistics.median(runs[str(n)]):.1f} | {ratio:.3f} |", flush=True)


if __name__ == "__main__":
    main()
