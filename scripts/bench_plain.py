"""Plain decode throughput: gmlx's engine against mlx-lm, side by side in one run.

Width 1: gmlx Engine (no drafter) vs mlx_lm.generate.generate_step.
Width 8: gmlx Engine with 8 concurrent requests vs mlx_lm's BatchGenerator.
Both sides use the same loaded float32 model object and the same BLAS. Runs alternate
and repeat; the reported ratio is the median of per-repeat ratios.

    python scripts/bench_plain.py                    # built-in model and a random ~140M model
    python scripts/bench_plain.py --models builtin --repeats 5 --tokens 128
"""

from __future__ import annotations

import argparse
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
from mlx_lm.generate import BatchGenerator, generate_step  # noqa: E402

from ab import median_ratio  # noqa: E402
from bench_models import forward_ms, make_random_model  # noqa: E402
from gmlx.config import EngineConfig  # noqa: E402
from gmlx.engine import Engine  # noqa: E402
from gmlx.models.loader import load_model  # noqa: E402
from gmlx.request import SamplingParams  # noqa: E402


def prompts_for(target, num: int, length: int = 16) -> list[list[int]]:
    text = Path(json.__file__).read_text()
    tokens = target.tokenizer.encode(text)
    return [tokens[i * 97 : i * 97 + length] for i in range(num)]


def gmlx_tok_per_s(target, prompts, num_tokens: int) -> float:
    engine = Engine(target, None, EngineConfig(prompt_cache_bytes=0))
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=num_tokens))
    engine.step()  # prefill + first tokens, outside the timed region as for mlx-lm below
    start, count = time.perf_counter(), 0
    while engine.has_unfinished():
        count += sum(len(o.new_token_ids) for o in engine.step())
    return count / (time.perf_counter() - start)


def mlx_lm_w1_tok_per_s(target, prompt, num_tokens: int) -> float:
    steps = generate_step(mx.array(prompt), target.model, max_tokens=num_tokens)
    next(steps)
    start, count = time.perf_counter(), 0
    for _ in steps:
        count += 1
    return count / (time.perf_counter() - start)


def mlx_lm_batch_tok_per_s(target, prompts, num_tokens: int) -> float:
    gen = BatchGenerator(target.model, max_tokens=num_tokens, stop_tokens=[])
    gen.insert(prompts, max_tokens=[num_tokens] * len(prompts))
    live, count, start = len(prompts), 0, None
    while live:
        responses = gen.next_generated()
        if start is None:  # first tokens come out of prefill, excluded as on the gmlx side
            start = time.perf_counter()
            live -= sum(r.finish_reason is not None for r in responses)
            continue
        count += len(responses)
        live -= sum(r.finish_reason is not None for r in responses)
    gen.close()
    return count / (time.perf_counter() - start)


def bench_model(name, target, repeats, num_tokens):
    rows = []
    for width in (1, 8):
        prompts = prompts_for(target, width)
        ours, theirs = [], []
        for _ in range(repeats):
            ours.append(gmlx_tok_per_s(target, prompts, num_tokens))
            if width == 1:
                theirs.append(mlx_lm_w1_tok_per_s(target, prompts[0], num_tokens))
            else:
                theirs.append(mlx_lm_batch_tok_per_s(target, prompts, num_tokens))
        ratio = median_ratio(zip(ours, theirs))
        baseline = "generate_step" if width == 1 else "BatchGenerator"
        rows.append(dict(model=name, width=width, gmlx_tok_s=statistics.median(ours),
                         mlx_lm_tok_s=statistics.median(theirs), baseline=baseline, ratio=ratio))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="builtin,random", help="comma list of builtin, random")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--random-dir", default=str(Path(tempfile.gettempdir()) / "gmlx-bench-random-140m"))
    args = parser.parse_args()
    rows = []
    for name in args.models.split(","):
        folder = None if name == "builtin" else make_random_model(Path(args.random_dir))
        target = load_model(folder)
        ms = forward_ms(target)
        label = f"{name} ({ms:.1f} ms/forward)"
        rows += bench_model(label, target, args.repeats, args.tokens)
    print("| model | width | gmlx tok/s | mlx-lm tok/s | mlx-lm baseline | ratio |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['width']} | {r['gmlx_tok_s']:.1f} | {r['mlx_lm_tok_s']:.1f} | "
              f"{r['baseline']} | {r['ratio']:.2f} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
