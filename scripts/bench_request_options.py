"""What a request's options cost (logprobs, prompt logprobs, repeat penalties, logit_bias), side by side
against a request without them.

Runs alternate (ABBA) on one engine per model; the ratio is the median of per-rep ratios.

    python scripts/bench_request_options.py                            # built-in and SmolLM2
    python scripts/bench_request_options.py --models smollm2 --widths 1,8 --logprobs 0,5,20 --repeats 5
    python scripts/bench_request_options.py --models smollm2 --sections prompt --prompt-tokens 128,512
    python scripts/bench_request_options.py --models smollm2 --sections penalties --drafter ngram

Sections:
  decode     decode tok/s of `--widths` requests with logprobs = N against none (--drafter: speculating)
  prompt     a prompt's prefill and first token with prompt_logprobs = 1 (an evaluation harness's
             loglikelihood: echo, logprobs 1, one token) against a plain one, no prompt cache
  penalties  decode tok/s with presence_penalty 0.5 and frequency_penalty 0.5 against none
  repetition decode tok/s with repetition_penalty 1.3 (prompt and answer tokens) against none
  bias       decode tok/s with a logit_bias of 300 tokens (-100 on ids prose never reaches) against none
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
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
from gmlx.request import MAX_LOGIT_BIAS_ENTRIES, SamplingParams  # noqa: E402

OFF = "off"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="builtin,smollm2", help="builtin | smollm2 | a model path, comma-separated")
    parser.add_argument("--drafter", default="none", help="the engine's drafter (none: plain decoding)")
    parser.add_argument("--widths", default="1,8", help="requests decoding together")
    parser.add_argument("--logprobs", default="0,5,20", help="the N of each side against no logprobs")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sections", default="decode,prompt,penalties,repetition,bias")
    parser.add_argument("--prompt-tokens", default="128,512", help="prompt lengths of the prompt section")
    args = parser.parse_args()
    sections = args.sections.split(",")
    for name in args.models.split(","):
        target = load_model(None if name == "builtin" else name)
        drafter = None if args.drafter == "none" else make_drafter(args.drafter, target)
        engine = Engine(target, drafter, EngineConfig(prompt_cache_bytes=0))
        if "decode" in sections:
            decode_section(engine, name, args)
        if "prompt" in sections:
            prompt_section(engine, name, args)
        if "penalties" in sections:
            penalties_section(engine, name, args)
        if "repetition" in sections:
            repetition_section(engine, name, args)
        if "bias" in sections:
            bias_section(engine, name, args)


def decode_section(engine, name: str, args) -> None:
    counts = [int(n) for n in args.logprobs.split(",")]
    print("| model | drafter | width | logprobs | tok/s without | tok/s with | with / without |")
    print("|---|---|---|---|---|---|---|")
    sides = {str(n): SamplingParams(max_tokens=args.tokens, logprobs=n) for n in counts}
    for width, runs in _decode_runs(engine, args, sides):
        for n in counts:
            print(f"| {name} | {args.drafter} | {width} | {n} | {_row(runs, str(n))}", flush=True)


def penalties_section(engine, name: str, args) -> None:
    _one_option_section(engine, name, args, "penalties",
                        SamplingParams(max_tokens=args.tokens, presence_penalty=0.5, frequency_penalty=0.5))


def repetition_section(engine, name: str, args) -> None:
    _one_option_section(engine, name, args, "repetition_penalty 1.3",
                        SamplingParams(max_tokens=args.tokens, repetition_penalty=1.3))


def bias_section(engine, name: str, args) -> None:
    # A ban list at the cap: the vocabulary's last 300 ids, which prose never reaches, so both
    # sides decode the same tokens and only the bias's cost differs.
    vocab_size = engine.target.vocab_size
    banned = {token_id: -100.0 for token_id in range(vocab_size - MAX_LOGIT_BIAS_ENTRIES, vocab_size)}
    _one_option_section(engine, name, args, f"a {len(banned)}-token logit_bias",
                        SamplingParams(max_tokens=args.tokens, logit_bias=banned))


def _one_option_section(engine, name: str, args, option: str, params: SamplingParams) -> None:
    print(f"| model | drafter | width | tok/s without | tok/s with {option} | with / without |")
    print("|---|---|---|---|---|---|")
    for width, runs in _decode_runs(engine, args, {"on": params}):
        print(f"| {name} | {args.drafter} | {width} | {_row(runs, 'on')}", flush=True)


def _decode_runs(engine, args, sides: dict[str, SamplingParams]):
    """(width, mode -> tok/s of each rep) at each of --widths: OFF (a plain request) and each side."""
    params_of = {OFF: SamplingParams(max_tokens=args.tokens), **sides}
    for width in (int(w) for w in args.widths.split(",")):
        prompts = heldout_text_prompts(engine.target.tokenizer, "prose", width, 128)
        yield width, alternate(list(params_of), args.repeats,
                               lambda mode: decode_tok_per_s(engine, prompts, params_of[mode])[0])


def _row(runs: dict, mode: str) -> str:
    """Without, with, and the median of per-rep ratios, as the tables' last three cells."""
    ratio = median_ratio(zip(runs[mode], runs[OFF]))
    return f"{statistics.median(runs[OFF]):.1f} | {statistics.median(runs[mode]):.1f} | {ratio:.3f} |"


def prompt_section(engine, name: str, args) -> None:
    print("| model | prompt tokens | ms without | ms with prompt_logprobs = 1 | with / without |")
    print("|---|---|---|---|---|")
    for num_tokens in (int(n) for n in args.prompt_tokens.split(",")):
        [prompt] = heldout_text_prompts(engine.target.tokenizer, "prose", 1, num_tokens)

        def run(mode: str) -> float:
            params = SamplingParams(max_tokens=1, prompt_logprobs=None if mode == OFF else 1)
            start_s = time.perf_counter()
            engine.add_request(prompt, params)
            while engine.has_unfinished():
                engine.step()
            return time.perf_counter() - start_s

        runs = alternate([OFF, "on"], args.repeats, run)
        ratio = median_ratio(zip(runs["on"], runs[OFF]))
        print(f"| {name} | {num_tokens} | {1000 * statistics.median(runs[OFF]):.0f} | "
              f"{1000 * statistics.median(runs['on']):.0f} | {ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
