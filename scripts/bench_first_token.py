"""When a first token comes, prompts prefilled apart against packed into the decode rows' forward
(spec/prefill_pacing.py), in process, at a closed-loop concurrency.

    python3 scripts/bench_first_token.py                       # built-in model, 32 clients, 384 requests
    python3 scripts/bench_first_token.py --clients 8 --reps 4

Two engines as `gmlx serve` builds them but for the packing switch (no prefill budget: every drain
or packed round takes up to 256 prompt tokens), each run sends the same unique prompts (the load
generator's held-out cuts, uniform 32-96 tokens, 64 new, greedy) from --clients clients. Runs
alternate in ABBA turns (scripts/ab.py). Reported per mode: aggregate tok/s, time to first token
p50 / p90, engine steps from arrival to first token p50 / p90, and the prompt tokens waiting at a
step's start when any wait (p50). Both modes must give every request the same tokens.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
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
from gmlx.config import EngineConfig  # noqa: E402
from gmlx.engine import Engine  # noqa: E402
from gmlx.platform.blas_select import cpu_model_name  # noqa: E402
from gmlx.request import SamplingParams  # noqa: E402
from workers.bench import model_files  # noqa: E402
from workers.bench.metrics import percentile  # noqa: E402
from workers.bench.workload import PromptMaker  # noqa: E402

MODES = {"apart": False, "packed": True}
MIN_PROMPT_TOKENS, MAX_PROMPT_TOKENS = 32, 96


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model path or name; the built-in model by default")
    parser.add_argument("--drafter", default="none")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=384)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write the results JSON here")
    return parser.parse_args()


def run(engine: Engine, prompts: list[list[int]], num_clients: int, max_tokens: int) -> dict:
    """Closed loop: num_clients requests in flight, each finished one replaced by the next."""
    params = SamplingParams(max_tokens=max_tokens)
    todo, index_of, tokens = list(range(len(prompts))), {}, {}
    arrival_s, arrival_step, ttft_s, ttft_steps, waiting_tokens = {}, {}, {}, {}, []
    num_steps = 0
    start_s = time.perf_counter()

    def send():
        i = todo.pop(0)
        index_of[engine.add_request(prompts[i], params)] = i
        tokens[i], arrival_s[i], arrival_step[i] = [], time.perf_counter(), num_steps

    for _ in range(min(num_clients, len(todo))):
        send()
    while engine.has_unfinished():
        waiting = sum(r.num_prefill_tokens - r.num_prefilled for r in engine.queue.waiting)
        if waiting:
            waiting_tokens.append(waiting)
        outputs = engine.step()
        num_steps += 1
        for output in outputs:
            i = index_of[output.request_id]
            if output.new_token_ids and i not in ttft_s:
                ttft_s[i], ttft_steps[i] = time.perf_counter() - arrival_s[i], num_steps - arrival_step[i]
            tokens[i] += output.new_token_ids
            if output.finish_reason is not None and todo:
                send()
    elapsed_s = time.perf_counter() - start_s
    return {"tok_per_s": sum(len(t) for t in tokens.values()) / elapsed_s, "num_steps": num_steps,
            "ttft_p50_ms": 1e3 * percentile(list(ttft_s.values()), 50),
            "ttft_p90_ms": 1e3 * percentile(list(ttft_s.values()), 90),
            "ttft_steps_p50": percentile(list(ttft_steps.values()), 50),
            "ttft_steps_p90": percentile(list(ttft_steps.values()), 90),
            "waiting_tokens_p50": statistics.median(waiting_tokens) if waiting_tokens else 0,
            "tokens": [tokens[i] for i in range(len(prompts))]}


def main() -> None:
    args = parse_args()
    engines = {mode: Engine.load(EngineConfig(model_path=args.model, drafter=args.drafter, is_prefill_packed=packed))
               for mode, packed in MODES.items()}
    first = next(iter(engines.values()))
    maker = PromptMaker(model_files.mlx_lm_folder(args.model) / "tokenizer.json", seed=1)
    rng = random.Random(0)
    texts = [maker.make(rng.randint(MIN_PROMPT_TOKENS, MAX_PROMPT_TOKENS)) for _ in range(args.requests + args.clients)]
    prompts = [first.tokenizer.encode(text) for text in texts]
    warm, prompts = prompts[: args.clients], prompts[args.clients:]  # warm-up prompts never reach the prompt cache's runs
    print(f"{first.model_path}: {args.clients} clients, {args.requests} requests, prompts "
          f"{MIN_PROMPT_TOKENS}-{MAX_PROMPT_TOKENS} tokens, max_tokens {args.max_tokens}, drafter {args.drafter}",
          flush=True)
    for engine in engines.values():
        run(engine, warm, args.clients, 8)  # first forwards, allocator
    runs = alternate(MODES, args.reps, lambda mode: run(engines[mode], prompts, args.clients, args.max_tokens))
    base = next(iter(MODES))
    is_same = all(r["tokens"] == runs[base][0]["tokens"] for m in MODES for r in runs[m])
    keys = ("tok_per_s", "ttft_p50_ms", "ttft_p90_ms", "ttft_steps_p50", "ttft_steps_p90", "waiting_tokens_p50")
    rows = [{"mode": mode, **{k: statistics.median(r[k] for r in runs[mode]) for k in keys},
             "per_rep_tok_per_s": [round(r["tok_per_s"], 1) for r in runs[mode]],
             "over_base": median_ratio((r["tok_per_s"], b["tok_per_s"]) for r, b in zip(runs[mode], runs[base]))}
            for mode in MODES]
    print(f"every request the same tokens in every run of both modes: {is_same}")
    print("| prompts | aggregate tok/s (per rep) | over apart | first token p50 / p90 ms | steps to first token "
          "p50 / p90 | prompt tokens waiting, p50 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['tok_per_s']:.1f} ({' / '.join(map(str, r['per_rep_tok_per_s']))}) | "
              f"{r['over_base']:.2f}x | {r['ttft_p50_ms']:.0f} / {r['ttft_p90_ms']:.0f} | "
              f"{r['ttft_steps_p50']:g} / {r['ttft_steps_p90']:g} | {r['waiting_tokens_p50']:g} |")
    print(f"{cpu_model_name()}, {platform.machine()}, {time.strftime('%Y-%m-%d')}")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows,
                                        "is_same": is_same}, indent=1))
    if not is_same:
        sys.exit("apart and packed prompts gave different tokens")


if __name__ == "__main__":
    main()
