"""Prefill speed: a lone prompt's time to its first token in gmlx's engine, the 4-bit many-row
kernel on and off, and llama.cpp's prompt processing (llama-bench pp) on the same GGUF, side by side.

Each round takes a new prompt and runs the two gmlx sides on it twice, ABBA (scripts/ab.py), each
on a fresh engine (no prompt-cache hit), then llama-bench once, so the box's drift falls on all
sides alike; greedy first tokens are checked equal between the gmlx sides. Reported: median
prompt tok/s and paired ratios (the median of per-rep ratios).

    python3 scripts/bench_prefill.py                                   # SmolLM2 4-bit, 512 tokens, 4 rounds
    python3 scripts/bench_prefill.py --tokens 512,1500 --llama-bench .cache/llama.cpp/bin/llama-bench
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's gmlx
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ab import alternate, median_ratio, median_ratio_of  # noqa: E402
from bench_compute_format import llama_bench_tok_per_s  # noqa: E402  (sets the BLAS up before mlx)
from bench_kernels import NEVER, kernel_setting  # noqa: E402

from gmlx.config import EngineConfig  # noqa: E402
from gmlx.drafters import make_drafter  # noqa: E402
from gmlx.engine import Engine  # noqa: E402
from gmlx.models.loader import load_model  # noqa: E402
from gmlx.models.source import resolve_model_path  # noqa: E402
from gmlx.platform import cpu_kernels  # noqa: E402
from gmlx.request import SamplingParams  # noqa: E402



def prefill_seconds(target, prompt: list[int]) -> tuple[float, int]:
    """Seconds from adding the prompt to its first token on a fresh engine, and that token."""
    engine = Engine(target, make_drafter("none", target), EngineConfig(max_context_tokens=len(prompt) + 64))
    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=1), request_id="prefill")
    while engine.has_unfinished():
        for output in engine.step():
            if output.new_token_ids:
                return time.perf_counter() - start, output.new_token_ids[0]
    raise RuntimeError("the prompt finished without a token")


def measure(target, default_min: int, tokens: list[int], num_tokens: int, num_rounds: int,
            llama: tuple[str, Path] | None) -> tuple[dict[str, list[dict]], list[float]]:
    """Per side, its 2 * num_rounds prefills in ABBA order (reps 2i and 2i + 1, one round, share
    the prompt at 7i); and with llama (llama-bench's path, the GGUF) its pp rate once a round."""
    rep_now, llama_rates = 0, []

    def run(side: str) -> dict:
        prompt = tokens[7 * (rep_now // 2) : 7 * (rep_now // 2) + num_tokens]
        # NEVER: the quad kernels' four-row walks at any row count.
        with kernel_setting("many_rows_min", default_min if side == "many" else NEVER):
            seconds, first = prefill_seconds(target, prompt)
        return {"tok_per_s": num_tokens / seconds, "first": first}

    def after_rep(rep: int) -> None:
        nonlocal rep_now
        rep_now = rep + 1
        if llama and rep % 2 == 1:
            llama_rates.append(llama_bench_tok_per_s(*llama, num_tokens, is_prompt=True))

    runs = alternate(("many", "walks"), 2 * num_rounds, run, after_rep)
    for many, walks in zip(runs["many"], runs["walks"]):
        assert many["first"] == walks["first"], f"first tokens differ: {many['first']} against {walks['first']}"
    return runs, llama_rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", default="512", help="prompt lengths, comma-separated")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench (scripts/build_llama_cpp.sh)")
    args = parser.parse_args()
    if not cpu_kernels.is_built():
        sys.exit(f"gmlx CPU kernels unavailable: {cpu_kernels.status()['reason']}")
    ext = cpu_kernels.extension()
    default_min = ext.many_rows_min()
    target = load_model(args.model)
    text = Path(statistics.__file__).read_text() + Path(argparse.__file__).read_text()  # real code and prose
    tokens = target.tokenizer.encode(text)
    print(f"{target.path}; many-row kernel from {default_min} rows; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    print("| prompt tokens | gmlx, many-row kernel (default) tok/s | gmlx, quad walks tok/s | default over walks (paired) "
          "| llama.cpp pp tok/s | gmlx over llama.cpp (paired) |")
    print("|---|---|---|---|---|---|")
    for num_tokens in (int(n) for n in args.tokens.split(",")):
        if num_tokens + 7 * args.rounds > len(tokens):
            sys.exit(f"--tokens {num_tokens} is longer than the text's {len(tokens)} tokens")
        runs, llama_rates = measure(target, default_min, tokens[: num_tokens + 7 * args.rounds], num_tokens,
                                    args.rounds, args.llama_bench and (args.llama_bench, resolve_model_path(args.model)))
        many = statistics.median(r["tok_per_s"] for r in runs["many"])
        walks = statistics.median(r["tok_per_s"] for r in runs["walks"])
        paired_walks = median_ratio_of(runs["many"], runs["walks"], "tok_per_s")
        llama, over_llama = "-", "-"
        if llama_rates:  # each rep's default against its round's llama-bench run
            paired = median_ratio((r["tok_per_s"], llama_rates[rep // 2]) for rep, r in enumerate(runs["many"]))
            llama = f"{statistics.median(llama_rates):.1f}"
            over_llama = f"{many / statistics.median(llama_rates):.2f}x ({paired:.2f})"
        print(f"| {num_tokens} | {many:.1f} | {walks:.1f} | {many / walks:.2f}x ({paired_walks:.2f}) | {llama} "
              f"| {over_llama} |", flush=True)


if __name__ == "__main__":
    main()
