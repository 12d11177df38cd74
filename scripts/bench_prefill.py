"""Prefill speed: a lone prompt's time to its first token in gmlx's engine, the 4-bit many-row
kernel on and off, and llama.cpp's prompt processing (llama-bench pp) on the same GGUF, side by side.

Each round runs every side once, in turn (ABBA for the two gmlx sides), on a fresh engine (no
prompt-cache hit), so the box's drift falls on all sides alike; greedy first tokens are checked
equal between the gmlx sides. Reported: median prompt tok/s and paired ratios.

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

from bench_compute_format import llama_bench_tok_per_s  # noqa: E402  (sets the BLAS up before mlx)

from gmlx.config import EngineConfig  # noqa: E402
from gmlx.drafters import make_drafter  # noqa: E402
from gmlx.engine import Engine  # noqa: E402
from gmlx.models.loader import load_model  # noqa: E402
from gmlx.models.source import resolve_model_path  # noqa: E402
from gmlx.platform import cpu_kernels  # noqa: E402
from gmlx.request import SamplingParams  # noqa: E402

NEVER = 1 << 30  # a many-row switch point no call reaches: the quad kernels' four-row walks


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
        rates = {"many": [], "walks": [], "llama": []}
        for round_index in range(args.rounds):
            prompt = tokens[7 * round_index : 7 * round_index + num_tokens]  # a new prompt each round
            firsts = {}
            order = ("many", "walks", "walks", "many") if round_index % 2 == 0 else ("walks", "many", "many", "walks")
            for side in order:
                ext.set_many_rows_min(default_min if side == "many" else NEVER)
                seconds, first = prefill_seconds(target, prompt)
                rates[side].append(num_tokens / seconds)
                firsts.setdefault(side, first)
            ext.set_many_rows_min(default_min)
            assert firsts["many"] == firsts["walks"], f"first tokens differ: {firsts}"
            if args.llama_bench:
                rates["llama"].append(llama_bench_tok_per_s(args.llama_bench, resolve_model_path(args.model),
                                                            num_tokens, is_prompt=True))
        # Paired: each round's two gmlx runs per side averaged, then ratios per round.
        per_round = {side: [statistics.fmean(v[2 * i : 2 * i + 2]) for i in range(args.rounds)]
                     for side, v in rates.items() if side != "llama"}
        paired_walks = statistics.median(m / w for m, w in zip(per_round["many"], per_round["walks"]))
        many, walks = statistics.median(rates["many"]), statistics.median(rates["walks"])
        llama = f"{statistics.median(rates['llama']):.1f}" if rates["llama"] else "-"
        over_llama = (f"{many / statistics.median(rates['llama']):.2f}x "
                      f"({statistics.median(m / l for m, l in zip(per_round['many'], rates['llama'])):.2f})"
                      if rates["llama"] else "-")
        print(f"| {num_tokens} | {many:.1f} | {walks:.1f} | {many / walks:.2f}x ({paired_walks:.2f}) | {llama} "
              f"| {over_llama} |", flush=True)


if __name__ == "__main__":
    main()
