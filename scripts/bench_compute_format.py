"""Width-1 decode of a quantized GGUF on CPU in each compute format, side by side in one run.

gmlx's engine loads the model once per format (GMLX_CPU_COMPUTE_FORMAT=float32 | quantized);
mlx-lm's generate_step runs on the GGUF converted to an mlx-lm folder (its 4-bit weights as
mlx-lm loads them); with --llama-bench, llama.cpp's llama-bench runs the same GGUF at as many
threads as there are CPUs. Runs alternate and repeat; reported: median tok/s and ratios to float32.
This is what `auto` in gmlx/models/compute_format.py rests on.

    python3 scripts/bench_compute_format.py                      # smollm2, 64 tokens, 3 repeats
    python3 scripts/bench_compute_format.py --model FILE.gguf --tokens 128 --repeats 5 --json
    python3 scripts/bench_compute_format.py --llama-bench .cache/llama.cpp/bin/llama-bench \
        --llama-gguf F32=.cache/llama.cpp/models/SmolLM2-135M-Instruct.F32.gguf
    python3 scripts/bench_compute_format.py --quant-activations float,int8 --no-mlx-lm
    python3 scripts/bench_compute_format.py --float-kernels 1,0 --no-mlx-lm   # float32 on panels vs the BLAS
    python3 scripts/bench_compute_format.py --model FOLDER --no-quantized --no-mlx-lm --float-kernels 1,0
    python3 scripts/bench_compute_format.py --depth 2000 --no-mlx-lm --llama-bench .cache/llama.cpp/bin/llama-bench
    python3 scripts/bench_compute_format.py --depth 2000 --kv model,float16 --no-mlx-lm   # the KV cache's type
    python3 scripts/bench_compute_format.py --model Q4_K_M.gguf --k-tiles 1,0 --no-float32 --no-mlx-lm
    python3 scripts/bench_compute_format.py --model Q5_0.gguf --switch GMLX_CPU_FIVE_BIT_TILES=1,0 --no-float32

--quant-activations loads the quantized format once per GMLX_CPU_QUANT_ACTIVATIONS mode (float:
float32 activations; int8: activations quantized per 32 inputs, integer dots), side by side.
--depth N decodes after about N tokens of context (real text before the question; llama-bench -d N),
where the attention over the KV cache, not the weights, sets much of a step's cost.
--kv loads each format once per GMLX_KV_DTYPE setting (model: the computed float32; float16: halves;
auto, the default: halves where the products quantize activations to int8).
--k-tiles loads the quantized format once per GMLX_CPU_K_TILES setting (1: Q4_K and Q6_K matrices as
K-tiles with their own scales; 0: as tiles from their triplets). --no-float32 skips the float32
engine (a large file's float32 copy may not fit in memory); ratios are then to the first engine.
--switch NAME=V1,V2 likewise per value of any GMLX_* setting read at load (GMLX_CPU_FIVE_BIT_TILES,
GMLX_CPU_IQ4_TILES: 1 keeps a GGUF's Q5_0/Q5_1 or IQ4 levels in the narrow tiles, 0 at 8 bits).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's gmlx

from gmlx.platform.blas import ensure_fast_blas  # noqa: E402

ensure_fast_blas()  # the fast BLAS before mlx is first imported
import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

from gmlx.config import EngineConfig, env_overrides  # noqa: E402
from gmlx.engine import Engine  # noqa: E402
from gmlx.generate import render_chat, stream_generate  # noqa: E402
from gmlx.models.gguf import write_mlx_lm_folder  # noqa: E402
from gmlx.models.source import resolve_model_path  # noqa: E402
from gmlx.platform.cpu_kernels import is_built as is_kernels_built  # noqa: E402
from gmlx.platform.cpu_kernels import read_bandwidth_gbs  # noqa: E402
from gmlx.request import SamplingParams  # noqa: E402

# An instruction the chat model answers at length, so no run stops early at EOS.
QUESTION = "Write a long essay about the history of the Roman Empire, with many details."


def prompt_ids(tokenizer, depth: int = 0) -> list[int]:
    """The question, as a chat turn where the tokenizer has a template; with depth, after enough
    real text (this Python's argparse source) that the prompt is about depth tokens long."""
    def encode(question: str) -> list[int]:
        if getattr(tokenizer, "chat_template", None) is None:  # a random-weight folder: the plain text
            return tokenizer.encode(question)
        return tokenizer.encode(render_chat(tokenizer, [{"role": "user", "content": question}]))

    ids = encode(QUESTION)
    if depth > len(ids):
        context = tokenizer.encode(Path(argparse.__file__).read_text())[: depth - len(ids)]
        ids = encode(tokenizer.decode(context) + "\n\n" + QUESTION)
    return ids


def gmlx_tok_per_s(engine: Engine, num_tokens: int, depth: int = 0) -> float:
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0)
    last = None
    for last in stream_generate(engine, params=params, token_ids=prompt_ids(engine.tokenizer, depth)):
        pass
    assert last.stats["generated_tokens"] > num_tokens // 2, last.stats  # a rate over a real run
    return last.stats["decode_tok_per_s"]


def mlx_lm_tok_per_s(model, tokenizer, num_tokens: int, depth: int = 0) -> float:
    prompt = mx.array(prompt_ids(tokenizer, depth))
    steps = generate_step(prompt, model, max_tokens=num_tokens)
    next(steps)  # the first token carries the prefill; time the decode only
    start = time.perf_counter()
    num_decoded = sum(1 for _ in steps)
    return num_decoded / (time.perf_counter() - start)


def llama_bench_tok_per_s(binary: str, model: Path, num_tokens: int, depth: int = 0, is_prompt: bool = False) -> float:
    """llama.cpp's token generation rate (llama-bench tg, one repetition) on the same GGUF, after
    depth tokens in its KV cache; is_prompt: its prompt processing rate (pp) instead."""
    sizes = ["-p", str(num_tokens), "-n", "0"] if is_prompt else ["-p", "0", "-n", str(num_tokens)]
    command = [binary, "-m", str(model), *sizes, "-t", str(os.cpu_count()),
               "-r", "1", "-o", "json", *(["-d", str(depth)] if depth else [])]  # older builds lack -d
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        raise RuntimeError(f"llama-bench failed: {result.stderr[-2000:]}")
    return float(json.loads(result.stdout)[0]["avg_ts"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--depth", type=int, default=0,
                        help="tokens of context before the decode (real text before the question; llama-bench -d)")
    parser.add_argument("--no-mlx-lm", action="store_true", help="skip the mlx-lm baseline")
    parser.add_argument("--llama-bench", default=None,
                        help="path of llama.cpp's llama-bench (scripts/build_llama_cpp.sh) to add as a row")
    parser.add_argument("--llama-gguf", action="append", default=[], metavar="LABEL=PATH",
                        help="another GGUF for llama-bench (e.g. F32=.cache/llama.cpp/models/X.F32.gguf, made "
                             "with llama-quantize --allow-requantize); repeatable")
    parser.add_argument("--quant-activations", default="",
                        help="comma list of GMLX_CPU_QUANT_ACTIVATIONS modes (float,int8), one quantized "
                             "engine each (default: one, under the current setting)")
    parser.add_argument("--no-quantized", action="store_true",
                        help="float32 engines only (a float32 model folder has no quantized format)")
    parser.add_argument("--float-kernels", default="",
                        help="comma list of GMLX_CPU_FLOAT_KERNELS settings (1,0), one float32 engine each "
                             "(1: panels on the kernels' threads, 'gmlx float32'; 0: the BLAS path, "
                             "'gmlx float32 (BLAS)'; default: one, under the current setting)")
    parser.add_argument("--kv", default="",
                        help="comma list of GMLX_KV_DTYPE settings (auto,model,float16), one engine of each format "
                             "each (default: one, under the current setting)")
    parser.add_argument("--k-tiles", default="",
                        help="comma list of GMLX_CPU_K_TILES settings (1,0), one quantized engine each "
                             "(default: one, under the current setting)")
    parser.add_argument("--switch", default="",
                        help="NAME=V1,V2: one quantized engine per value of the GMLX_* setting NAME "
                             "(e.g. GMLX_CPU_IQ4_TILES=1,0; default: one, under the current setting)")
    parser.add_argument("--no-float32", action="store_true",
                        help="no float32 engine (ratios to the first engine instead)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    source = resolve_model_path(args.model)
    llama_models = {}
    if args.llama_bench:
        llama_models["llama.cpp"] = source
        for item in args.llama_gguf:
            label, sep, path = item.partition("=")
            if not sep or not Path(path).is_file():
                parser.error(f"--llama-gguf {item!r}: expected LABEL=PATH of an existing file")
            llama_models[f"llama.cpp {label}"] = Path(path)

    engines = {}
    # engine name -> (its name without the KV setting, its GMLX_KV_DTYPE or None); the setting is
    # resolved when the model loads (LoadedModel.kv_dtype).
    variant_of = {}
    modes = [m.strip() for m in args.quant_activations.split(",") if m.strip()]
    float_settings = [f.strip() for f in args.float_kernels.split(",") if f.strip()]
    kv_settings = [k.strip() for k in args.kv.split(",") if k.strip()] or [None]

    def load(name: str, overrides: dict) -> None:
        for kv in kv_settings:
            full_name = name + (f" {kv} KV" if kv and len(kv_settings) > 1 else "")
            with env_overrides({**overrides, **({"GMLX_KV_DTYPE": kv} if kv else {})}):
                engines[full_name] = Engine.load(EngineConfig(model_path=str(source)))
            variant_of[full_name] = (name, kv)

    k_tile_settings = [k.strip() for k in args.k_tiles.split(",") if k.strip()] or [None]
    switch_name, _, switch_values = args.switch.partition("=")
    if args.switch and not (switch_name.startswith("GMLX_") and switch_values):
        parser.error(f"--switch {args.switch!r}: expected GMLX_NAME=V1,V2")
    switch_settings = [v.strip() for v in switch_values.split(",") if v.strip()] or [None]
    for setting in [] if args.no_float32 else float_settings or [None]:
        load("gmlx float32" + (" (BLAS)" if setting == "0" else ""),
             {"GMLX_CPU_COMPUTE_FORMAT": "float32", **({"GMLX_CPU_FLOAT_KERNELS": setting} if setting else {})})
    for mode in [] if args.no_quantized else modes or [None]:
        for k_tiles in k_tile_settings:
            for value in switch_settings:
                load("gmlx quantized" + (f" ({mode} x)" if mode else "") + (" (K-tiles off)" if k_tiles == "0" else "")
                     + (f" ({switch_name}={value})" if value is not None else ""),
                     {"GMLX_CPU_COMPUTE_FORMAT": "quantized", **({"GMLX_CPU_QUANT_ACTIVATIONS": mode} if mode else {}),
                      **({"GMLX_CPU_K_TILES": k_tiles} if k_tiles else {}),
                      **({switch_name: value} if value is not None else {})})
    if not engines:
        parser.error("no engine to run: --no-float32 with --no-quantized")
    baseline = None
    if not args.no_mlx_lm:
        import mlx_lm

        scratch = tempfile.TemporaryDirectory(prefix="gmlx-bench-format-")
        baseline = mlx_lm.load(str(write_mlx_lm_folder(source, scratch.name)))

    names = list(engines) + (["mlx-lm 4-bit"] if baseline else []) + list(llama_models)
    results = {name: [] for name in names}
    for engine in engines.values():  # warm-up: compile, touch every weight once
        gmlx_tok_per_s(engine, 16)
    dram_gbs = []  # this machine's read rate, once per repeat: the box's neighbours move it
    for _ in range(args.repeats):
        dram_gbs.append(read_bandwidth_gbs(512 << 20, 3) if is_kernels_built() else float("nan"))
        for name in engines:
            results[name].append(gmlx_tok_per_s(engines[name], args.tokens, args.depth))
        if baseline:
            results["mlx-lm 4-bit"].append(mlx_lm_tok_per_s(*baseline, args.tokens, args.depth))
        for name, path in llama_models.items():
            results[name].append(llama_bench_tok_per_s(args.llama_bench, path, args.tokens, args.depth))

    medians = {name: statistics.median(values) for name, values in results.items()}
    reference_name = next((n for n in engines if n.startswith("gmlx float32")), next(iter(engines)))
    reference = medians[reference_name]
    dram = statistics.median(dram_gbs)
    # Weight bytes a token reads (as loaded: quad layout, float16 scales) per second, of DRAM.
    weight_gbs = {name: medians[name] * engine.target.num_weight_bytes / 1e9 for name, engine in engines.items()}
    llama = medians.get("llama.cpp")
    # Each repeat's own ratio, then their median: a repeat's engines ran the same minute of this
    # shared box, which a ratio of medians taken over different minutes does not see.
    pairs = [(name, peer) for name in engines for peer in llama_models]
    first_kv_of = {base: name for name, (base, kv) in variant_of.items() if kv == kv_settings[0]}
    pairs += [(name, first_kv_of[base]) for name, (base, kv) in variant_of.items() if kv != kv_settings[0]]
    pairs += [(name, name.replace(" (K-tiles off)", "")) for name in engines if " (K-tiles off)" in name]
    paired = {f"{name} / {peer}": statistics.median(a / b for a, b in zip(results[name], results[peer]))
              for name, peer in pairs}
    num_prompt_tokens = len(prompt_ids(next(iter(engines.values())).tokenizer, args.depth))
    report = {"model": str(source), "tokens": args.tokens, "repeats": args.repeats, "depth": args.depth,
              "num_prompt_tokens": num_prompt_tokens,
              "cpu": platform.processor() or platform.machine(), "all_tok_per_s": results,
              "tok_per_s": medians, "reference": reference_name,
              "ratio_to_reference": {n: v / reference for n, v in medians.items()},
              "ratio_to_gmlx_float32": ({n: v / reference for n, v in medians.items()}
                                        if reference_name.startswith("gmlx float32") else None),
              "ratio_to_llama_cpp": {n: v / llama for n, v in medians.items()} if llama else None,
              "paired_ratio": paired, "dram_gbs": dram_gbs, "weight_gbs": weight_gbs,
              "weight_of_dram": {n: g / dram for n, g in weight_gbs.items()}}
    if args.json:
        print(json.dumps(report))
        return
    context = f", after a {num_prompt_tokens}-token prompt (llama-bench -d {args.depth})" if args.depth else ""
    print(f"{source.name}, width 1, {args.tokens} tokens{context}, median of {args.repeats}, "
          f"OpenBLAS threads {os.environ.get('OPENBLAS_NUM_THREADS')}, llama-bench -t {os.cpu_count()}")
    print(f"  DRAM read {dram:.1f} GB/s (median of {', '.join(f'{d:.1f}' for d in dram_gbs)})")
    for name, value in medians.items():
        versus = f", {value / llama:.2f}x llama.cpp" if llama else ""
        weights = (f"; weights {weight_gbs[name]:.1f} GB/s = {weight_gbs[name] / dram:.2f} of DRAM"
                   if name in weight_gbs else "")
        runs = ", ".join(f"{v:.1f}" for v in results[name])
        print(f"  {name:26s} {value:7.2f} tok/s  ({value / reference:.2f}x {reference_name}{versus}{weights}) [{runs}]")
    if paired:
        print("  paired (median of each repeat's own ratio): "
              + "; ".join(f"{pair} {ratio:.2f}x" for pair, ratio in paired.items()))


if __name__ == "__main__":
    main()
