"""Chat requests under a tight KV budget: rows that reserve their whole max_tokens against rows
that reserve 256 tokens of growth and are evicted when they outgrow the budget (engine.py).

    python3 scripts/bench_kv_eviction.py                  # SmolLM2, 48 MiB, 8 clients, max_tokens 1024
    python3 scripts/bench_kv_eviction.py --kv-mb 96 --clients 4 --reps 2

A chat client that leaves max_tokens high (a default asks for the whole context) gets an answer
of a few dozen to a few hundred tokens, ended by EOS. Reserving max_tokens for every row, the
budget holds few rows however short the answers; reserving growth, it holds what the rows
actually use. Two engines as `gmlx serve` builds them (Engine.load: the n-gram drafter, the
prompt cache on, the start-up cost table), each with the budget and GMLX_KV_RESERVE_TOKENS 0 or
256; each run sends the same --requests chat turns (greedy) from --clients closed-loop clients.
Runs alternate
in ABBA turns (scripts/ab.py); reported per mode: aggregate tok/s over the run, the median time
to first token, the most rows decoding at once, evictions; ratios are medians of per-rep ratios.
Both modes must give every request the same tokens (eviction resumes exactly).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from gmlx.platform.blas import ensure_fast_blas  # noqa: E402

ensure_fast_blas()  # the fast BLAS before mlx is first imported

from ab import alternate, median_ratio  # noqa: E402
from gmlx.config import EngineConfig, env_overrides  # noqa: E402
from gmlx.engine import Engine  # noqa: E402
from gmlx.platform.blas_select import cpu_model_name  # noqa: E402
from gmlx.request import SamplingParams  # noqa: E402

TURNS = (  # everyday chat turns: answers from one line to a few hundred tokens
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain recursion in two sentences.",
    "Give me three tips for sleeping well.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Summarize the plot of Romeo and Juliet.",
    "Translate 'good morning, how are you?' into Spanish.",
    "Write a haiku about autumn leaves.",
    "What is the difference between a virus and a bacterium?",
    "Suggest a name for a small bakery.",
    "How many legs does a spider have?",
    "Describe how a bicycle gear works.",
    "Write a polite email declining a meeting invitation.",
    "Why is the sky blue?",
    "List five fruits that are high in vitamin C.",
)
MODES = {"reserve max_tokens": "0", "reserve 256": "256"}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--kv-mb", type=int, default=48, help="GMLX_KV_CACHE_MB of both engines")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=16, help="chat turns a run sends (TURNS, cycled)")
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the results JSON here")
    return parser.parse_args()


def make_engine(model: str, kv_mb: int, reserve_tokens: str) -> Engine:
    with env_overrides({"GMLX_KV_RESERVE_TOKENS": reserve_tokens}):
        return Engine.load(EngineConfig(model_path=model, drafter="ngram", kv_cache_bytes=kv_mb << 20))


def run(engine: Engine, prompts: list[list[int]], num_clients: int, max_tokens: int) -> dict:
    """Closed loop: num_clients requests in flight, each finished one replaced by the next."""
    params = SamplingParams(max_tokens=max_tokens)
    before = dict(engine.counters)
    todo, index_of, tokens, ttft_s, arrival_s = list(range(len(prompts))), {}, {}, {}, {}
    num_rows = 0
    start_s = time.perf_counter()

    def send():
        i = todo.pop(0)
        index_of[engine.add_request(prompts[i], params)] = i
        tokens[i], arrival_s[i] = [], time.perf_counter()

    for _ in range(min(num_clients, len(todo))):
        send()
    while engine.has_unfinished():
        for output in engine.step():
            i = index_of[output.request_id]
            if output.new_token_ids and i not in ttft_s:
                ttft_s[i] = time.perf_counter() - arrival_s[i]
            tokens[i] += output.new_token_ids
            if output.finish_reason is not None and todo:
                send()
        num_rows = max(num_rows, 0 if engine.batch is None else engine.batch.num_rows)
    elapsed_s = time.perf_counter() - start_s
    return {"tok_per_s": sum(len(t) for t in tokens.values()) / elapsed_s, "elapsed_s": elapsed_s,
            "ttft_s": statistics.median(ttft_s.values()), "max_rows": num_rows,
            "evictions": engine.counters["num_kv_evictions"] - before["num_kv_evictions"],
            "tokens": [tokens[i] for i in range(len(prompts))]}


def main() -> None:
    args = parse_args()
    engines = {mode: make_engine(args.model, args.kv_mb, value) for mode, value in MODES.items()}
    first = next(iter(engines.values()))
    prompts = [first.tokenizer.apply_chat_template([{"role": "user", "content": TURNS[i % len(TURNS)]}],
                                                   add_generation_prompt=True) for i in range(args.requests)]
    print(f"{args.model}: {first.target.kv_bytes_per_token} KV bytes a token, budget {args.kv_mb} MiB, "
          f"a row holds {first.max_row_tokens} tokens; {args.clients} clients, {args.requests} requests, "
          f"max_tokens {args.max_tokens}", flush=True)
    for engine in engines.values():
        run(engine, prompts[: args.clients], args.clients, 8)  # warm-up: first forwards, allocator
    runs = alternate(MODES, args.reps, lambda mode: run(engines[mode], prompts, args.clients, args.max_tokens))
    lengths = [len(t) for t in runs[next(iter(MODES))][0]["tokens"]]
    is_same = all(r["tokens"] == runs[m][0]["tokens"] for m in MODES for r in runs[m])
    base = next(iter(MODES))
    rows = []
    for mode in MODES:
        rs = runs[mode]
        rows.append({"mode": mode, "tok_per_s": statistics.median(r["tok_per_s"] for r in rs),
                     "ttft_s": statistics.median(r["ttft_s"] for r in rs),
                     "max_rows": max(r["max_rows"] for r in rs),
                     "evictions": statistics.median(r["evictions"] for r in rs),
                     "over_base": median_ratio((r["tok_per_s"], b["tok_per_s"]) for r, b in zip(rs, runs[base]))})
    print(f"answer lengths (tokens): median {statistics.median(lengths)}, min {min(lengths)}, max {max(lengths)}; "
          f"every request the same tokens in every run of both modes: {is_same}")
    print("| reservation | aggregate tok/s | over reserve max_tokens | median TTFT s | most rows at once "
          "| evictions a run |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['tok_per_s']:.1f} | {r['over_base']:.2f}x | {r['ttft_s']:.2f} | {r['max_rows']} "
              f"| {r['evictions']:g} |")
    print(f"{cpu_model_name()}, {platform.machine()}, {time.strftime('%Y-%m-%d')}")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows,
                                        "lengths": lengths, "is_same": is_same}, indent=1))
    if not is_same:
        sys.exit("the two reservations gave different tokens")


if __name__ == "__main__":
    main()
