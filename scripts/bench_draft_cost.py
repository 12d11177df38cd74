#!/usr/bin/env python
"""What one MTP draft costs at one row, by part, beside a target decode step.

    python scripts/bench_draft_cost.py                       # SmolLM2 Q4_1 and its shipped head
    python scripts/bench_draft_cost.py --head PATH --runs 5

A draft is the head's call (its products float32, or in the target's format in the CPU kernels)
then the output product and argmax over the whole vocabulary or the head's draft vocabulary. Each
variant is timed as a chain of --depth drafts (each feeding the next, as the drafter runs them),
best of --runs runs of --reps chains, variants interleaved run by run; ms per draft.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gmlx.platform.blas import ensure_fast_blas  # noqa: E402

ensure_fast_blas()  # the fast BLAS before mlx is first imported

import argparse  # noqa: E402
import time  # noqa: E402

import mlx.core as mx  # noqa: E402

from gmlx.cache.ragged import make_ragged_cache  # noqa: E402
from gmlx.models.draft_vocab import make_draft_vocab_head  # noqa: E402
from gmlx.models.head_registry import find_shipped_head  # noqa: E402
from gmlx.models.loader import load_model  # noqa: E402
from gmlx.models.mtp_head import load_mtp_head  # noqa: E402
from gmlx.platform.cpu_drafter_products import quantized_format  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--head", type=Path, default=None, help="an MTP head folder (default: the one shipped for --model)")
    p.add_argument("--depth", type=int, default=3, help="drafts a chain")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--runs", type=int, default=3)
    return p.parse_args()


def ms_per_call(fn, reps: int) -> float:
    for _ in range(10):
        mx.eval(fn())
    start_s = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    return (time.perf_counter() - start_s) / reps * 1e3


def main():
    args = parse_args()
    target = load_model(args.model)
    head_dir = args.head or find_shipped_head(target.path)
    if head_dir is None:
        raise SystemExit(f"no MTP head ships for {target.path}: give --head")
    target_format = quantized_format(target.body.layers[0])
    heads = {"float32": load_mtp_head(head_dir), "target format": load_mtp_head(head_dir, target_format)}
    ids = heads["float32"].draft_token_ids
    outputs = {"whole vocabulary": make_draft_vocab_head(target, None)}
    if ids is not None:
        outputs[f"draft vocabulary ({ids.size})"] = make_draft_vocab_head(target, mx.array(ids))
    embed = target.body.embed_tokens
    hidden = mx.random.normal((1, 1, target.hidden_size), key=mx.random.key(0))
    token = mx.array([[42]], dtype=mx.int32)

    def chain(head, output):
        h, t = hidden, token
        for _ in range(args.depth):
            h = head(h, t, embed)
            t = output.greedy(h)
        return t

    caches = make_ragged_cache(target.num_layers, 1, stored_dtype=target.kv_dtype)
    mx.eval(target.forward(mx.arange(100, 164, dtype=mx.int32)[None], caches)[1])

    def step():  # one decode forward on a 64-token context, its KV written then trimmed
        logits = target.forward(mx.array([[5]], dtype=mx.int32), caches)[1]
        mx.eval(logits)
        for cache in caches:
            cache.trim(1)
        return logits

    variants = {"target decode step": (step, 1)} | {
        f"head {h}, {o}": (lambda hd=heads[h], out=outputs[o]: chain(hd, out), args.depth)
        for h in heads for o in outputs}
    best = {name: float("inf") for name in variants}
    for _ in range(args.runs):
        for name, (fn, per) in variants.items():
            best[name] = min(best[name], ms_per_call(fn, args.reps) / per)
    print(f"{target.path}; head {head_dir}: products {heads['float32'].layout} / {heads['target format'].layout}")
    print("| variant | ms a draft (the first row: a decode step) |\n|---|---|")
    for name, ms in best.items():
        print(f"| {name} | {ms:.3f} |")


if __name__ == "__main__":
    main()
