#!/usr/bin/env python
"""What a speculative round pays that a plain round hides: the host work between two verifies,
and a forward waited for alone against one dispatched behind the previous read.

    python scripts/bench_round_gap.py                      # SmolLM2 Q4_1, n-gram at depth 1 and 3
    python scripts/bench_round_gap.py --depths 1,2,3,4 --tokens 400 --runs 8

gap: the engine decodes one greedy request at a fixed n-gram depth (width 1); per round, the wall
time between one verify's read returning and the next verify's dispatch (everything the host does
there: delivery, bookkeeping, drafting, building the forward's graph), and the wait for the read,
medians over the rounds. forwards: a forward of 1, 2 or 4 positions over a 64-token KV waited for
alone (dispatch, read, trim) against a one-position forward dispatched before the previous one is
read (what a plain round does), alternated run by run; ms per forward, medians over runs.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gmlx.platform.blas import ensure_fast_blas  # noqa: E402

ensure_fast_blas()  # the fast BLAS before mlx is first imported

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import mlx.core as mx  # noqa: E402

from gmlx.cache.ragged import make_ragged_cache  # noqa: E402
from gmlx.config import EngineConfig  # noqa: E402
from gmlx.engine import Engine  # noqa: E402
from gmlx.request import SamplingParams  # noqa: E402
from gmlx.spec import speculative  # noqa: E402

PROMPT = "Write a long story about a dragon who learns to code in Python. Once upon a time"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--depths", default="1,3", help="n-gram depths for the gap")
    p.add_argument("--tokens", type=int, default=300, help="tokens decoded per depth")
    p.add_argument("--runs", type=int, default=6, help="alternations of the forwards")
    p.add_argument("--reps", type=int, default=100, help="forwards per run")
    return p.parse_args()


class _TimedEval:
    """mlx.core as speculative.py sees it, with each mx.eval's start and end kept."""

    def __init__(self):
        self.spans: list[tuple[float, float]] = []

    def __getattr__(self, name):
        return getattr(mx, name)

    def eval(self, *arrays):
        start_s = time.perf_counter()
        mx.eval(*arrays)
        self.spans.append((start_s, time.perf_counter()))


def round_gap(model: str, depth: int, num_tokens: int) -> dict:
    """Median host gap between verifies and median wait in each, ms, at this fixed depth."""
    engine = Engine.load(EngineConfig(model_path=model, drafter="ngram", num_draft_tokens=depth,
                                      is_adaptive_depth=False, prompt_cache_bytes=0))
    prompt = engine.tokenizer.encode(PROMPT)
    timed = _TimedEval()
    speculative.mx = timed
    try:
        for max_tokens in (32, num_tokens):  # the first request warms up
            timed.spans.clear()
            engine.add_request(prompt, SamplingParams(max_tokens=max_tokens))
            while engine.has_unfinished():
                engine.step()
    finally:
        speculative.mx = mx
    gaps = [b[0] - a[1] for a, b in zip(timed.spans, timed.spans[1:])]
    waits = [end - start for start, end in timed.spans]
    return {"depth": depth, "rounds": len(timed.spans), "host_gap_ms": round(1e3 * statistics.median(gaps), 3),
            "wait_ms": round(1e3 * statistics.median(waits), 3)}


def forwards(model: str, num_runs: int, reps: int) -> dict:
    """ms per forward: waited alone at 1, 2, 4 positions, and pipelined at 1, alternated run by run."""
    from gmlx.models.loader import load_model

    target = load_model(model)
    caches = make_ragged_cache(target.num_layers, 1, stored_dtype=target.kv_dtype)
    mx.eval(target.forward(mx.arange(100, 164, dtype=mx.int32)[None], caches)[1])

    def step(tokens):
        logits = target.forward(tokens, caches)[1]
        return mx.argmax(logits[:, -1], axis=-1).astype(mx.int32)

    def alone(num_positions):
        tokens = mx.array([[5] * num_positions], dtype=mx.int32)
        start_s = time.perf_counter()
        for _ in range(reps):
            step(tokens).item()
            for cache in caches:
                cache.trim_rows([num_positions])
        return (time.perf_counter() - start_s) / reps * 1e3

    def pipelined():
        ahead = step(mx.array([[5]], dtype=mx.int32))
        mx.async_eval(ahead)
        start_s = time.perf_counter()
        for _ in range(reps):
            following = step(ahead[:, None])
            mx.async_eval(following)
            for cache in caches:  # the next forward writes where this one did: the same KV length
                cache.trim_rows([1])
            ahead.item()
            ahead = following
        ahead.item()
        elapsed_ms = (time.perf_counter() - start_s) / reps * 1e3
        for cache in caches:
            cache.trim_rows([1])
        return elapsed_ms

    runs = {"pipelined 1": [], "alone 1": [], "alone 2": [], "alone 4": []}
    for i in range(num_runs):
        order = list(runs) if i % 2 == 0 else list(runs)[::-1]
        for name in order:
            runs[name].append(pipelined() if name == "pipelined 1" else alone(int(name.split()[1])))
    return {name: round(statistics.median(ms), 2) for name, ms in runs.items()}


def main():
    args = parse_args()
    for depth in (int(d) for d in args.depths.split(",")):
        print(round_gap(args.model, depth, args.tokens), flush=True)
    print(forwards(args.model, args.runs, args.reps), flush=True)


if __name__ == "__main__":
    main()
