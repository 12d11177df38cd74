"""gmlx's greedy tokens against llama.cpp's on the same GGUF: 20 prompts, first 32 tokens.

llama.cpp runs as `llama-completion` (built by scripts/build_llama_cpp.sh) with greedy sampling
and prints text only, so the comparison walks gmlx's tokens: the first one whose text leaves
llama.cpp's output is the divergence point. There the script reports gmlx's logit margin (top-1
minus top-2 logit at that position, from one forward over prompt + generated tokens): a small
margin means a near-tie that rounding differences can flip, a large one a real disagreement.

    python3 scripts/verify_llama_cpp.py                            # smollm2, gmlx's default format
    GMLX_CPU_COMPUTE_FORMAT=quantized python3 scripts/verify_llama_cpp.py --markdown
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this tree's gmlx

from gmlx.platform.blas import ensure_fast_blas  # noqa: E402

ensure_fast_blas()  # the fast BLAS before mlx is first imported
import mlx.core as mx  # noqa: E402

from gmlx.cache.ragged import make_ragged_cache  # noqa: E402
from gmlx.config import EngineConfig  # noqa: E402
from gmlx.engine import Engine  # noqa: E402
from gmlx.generate import render_chat  # noqa: E402
from gmlx.models.source import resolve_model_path  # noqa: E402
from gmlx.request import SamplingParams  # noqa: E402

NUM_TOKENS = 32
TEXT_PROMPTS = [
    "The capital of France is",
    "The largest planet in the solar system is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "import numpy as np\n\ndef",
    "The theory of relativity was developed by",
    "Here is a recipe for pancakes:",
    "In 1969, astronauts",
]
CHAT_QUESTIONS = [
    "What is the capital of Japan?",
    "Give me three tips for sleeping better.",
    "Explain photosynthesis in one sentence.",
    "Write a haiku about autumn.",
    "What is 12 times 7?",
    "How do I reverse a list in Python?",
    "Who wrote Romeo and Juliet?",
    "Why is the sky blue?",
    "Translate 'good morning' into French.",
    "Name a healthy breakfast.",
]


def llama_cpp_text(binary: Path, model: Path, prompt: str, num_threads: int) -> str:
    command = [str(binary), "-m", str(model), "-p", prompt, "-n", str(NUM_TOKENS), "--temp", "0",
               "--top-k", "1", "--seed", "0", "-c", "1024", "-t", str(num_threads), "-no-cnv",
               "--no-display-prompt", "--simple-io", "--no-warmup", "--no-escape", "--no-repack"]
    result = subprocess.run(command, capture_output=True, timeout=600, stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:3])} failed: {result.stderr.decode(errors='replace')[-2000:]}")
    text = result.stdout.decode("utf-8", errors="replace")
    return text.split(" [end of text]")[0]  # its EOS marker, not model text


def gmlx_tokens(engine: Engine, prompts: list[list[int]], num_tokens: int = NUM_TOKENS) -> list[list[int]]:
    """num_tokens greedy tokens per prompt, all prompts decoding in one batch."""
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0)
    rows = {engine.add_request(prompt, params): i for i, prompt in enumerate(prompts)}
    tokens = [[] for _ in prompts]
    num_finished = 0
    while num_finished < len(prompts):
        for output in engine.step():
            tokens[rows[output.request_id]] += output.new_token_ids
            num_finished += output.finish_reason is not None
    return tokens


def margins_at(engine: Engine, prompt: list[int], generated: list[int], index: int, reference_rest: str) -> dict:
    """At generated token `index`: gmlx's top-1 minus top-2 logit, and how far below gmlx's top
    llama.cpp's choice sits in gmlx's logits (its rank, and the logit gap). The forward runs on
    gmlx's own ragged cache, so its kernels' attention: the numerics the engine decoded with."""
    tokens = mx.array([prompt + generated[:index]])
    _, logits = engine.target.forward(tokens, make_ragged_cache(engine.target.num_layers, stored_dtype=engine.target.kv_dtype))
    row = logits[0, -1].astype(mx.float32)
    top = mx.sort(row)[-2:]
    result = {"margin": float(top[1] - top[0])}
    theirs = engine.tokenizer.encode(reference_rest)[:1]  # llama.cpp's next token, re-tokenized
    if theirs:
        result["llama_cpp_rank"] = int((row > row[theirs[0]]).sum()) + 1
        result["llama_cpp_gap"] = float(top[1] - row[theirs[0]])
    return result


def token_divergence(tokenizer, generated: list[int], index: int, reference_text: str) -> int:
    """Back from a text divergence to the token where the two sides chose differently: gmlx's
    " " then "7" against llama.cpp's " a" leaves the text only at "7", but the choice that
    differed was " " (llama.cpp's next token re-tokenized from there is not gmlx's)."""
    while index > 0:
        before = tokenizer.decode(generated[: index - 1])
        theirs = tokenizer.encode(reference_text[len(before):])[:1]
        if theirs == generated[index - 1 : index]:
            break
        index -= 1
    return index


def divergence(tokenizer, generated: list[int], reference_text: str, eos_ids) -> int | None:
    """Index of gmlx's first token whose text leaves llama.cpp's output; None if they agree."""
    text = ""
    for i, token in enumerate(generated):
        if token in eos_ids:
            return None if reference_text == text else i
        text = tokenizer.decode(generated[: i + 1])
        stable = text.rstrip("\ufffd")  # a partial UTF-8 character decodes as U+FFFD
        if not reference_text.startswith(stable):
            return i
    return None if reference_text.startswith(text) else len(generated)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--llama-cpp-bin", default=str(ROOT / ".cache/llama.cpp/bin"))
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--markdown", action="store_true", help="print a table for BENCHMARKS.md")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model = resolve_model_path(args.model)
    binary = Path(args.llama_cpp_bin) / "llama-completion"
    if not binary.is_file():
        sys.exit(f"{binary} is missing: run bash scripts/build_llama_cpp.sh")

    engine = Engine.load(EngineConfig(model_path=str(model)))
    tokenizer = engine.tokenizer
    texts = TEXT_PROMPTS + [render_chat(tokenizer, [{"role": "user", "content": q}]) for q in CHAT_QUESTIONS]
    prompts = [tokenizer.encode(text) for text in texts]
    generated = gmlx_tokens(engine, prompts)
    rows = []
    for text, prompt, tokens in zip(texts, prompts, generated):
        reference = llama_cpp_text(binary, model, text, args.threads)
        index = divergence(tokenizer, tokens, reference, engine.target.eos_token_ids)
        if index is not None and index < len(tokens):
            index = token_divergence(tokenizer, tokens, index, reference)
        row = {"prompt": text if text in TEXT_PROMPTS else "chat: " + CHAT_QUESTIONS[texts.index(text) - len(TEXT_PROMPTS)],
               "num_tokens": len(tokens), "diverges_at": index, "gmlx": tokenizer.decode(tokens), "llama_cpp": reference}
        if index is not None and index < len(tokens):
            common = tokenizer.decode(tokens[:index])
            row.update(margins_at(engine, prompt, tokens, index, reference[len(common):]))
        rows.append(row)
    num_equal = sum(row["diverges_at"] is None for row in rows)
    if args.json:
        print(json.dumps({"model": str(model), "num_equal": num_equal, "rows": rows}))
        return
    print(f"{model.name}: {num_equal}/{len(rows)} prompts give llama.cpp's greedy text for {NUM_TOKENS} tokens "
          f"(CPU compute format: {os.environ.get('GMLX_CPU_COMPUTE_FORMAT', 'auto')})")
    if args.markdown:
        print("\n| prompt | gmlx tokens | first divergence | gmlx top-1 minus top-2 there | llama.cpp's token in gmlx: rank, gap |"
              "\n|---|---|---|---|---|")
    for row in rows:
        where = "none" if row["diverges_at"] is None else f"token {row['diverges_at']}"
        margin = f"{row['margin']:.3f}" if "margin" in row else "-"
        theirs = f"{row['llama_cpp_rank']}, {row['llama_cpp_gap']:.3f}" if "llama_cpp_rank" in row else "-"
        label = json.dumps(row["prompt"])[1:-1][:48]
        if args.markdown:
            print(f"| `{label}` | {row['num_tokens']} | {where} | {margin} | {theirs} |")
        else:
            print(f"  {label:50s} {where:10s} margin {margin}  llama.cpp's token: rank, gap {theirs}")
            if row["diverges_at"] is not None:
                print(f"    gmlx:      {row['gmlx']!r}\n    llama.cpp: {row['llama_cpp']!r}")


if __name__ == "__main__":
    main()
