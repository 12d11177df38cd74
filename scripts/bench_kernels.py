"""Kernel-only table: gmlx's quantized CPU kernel against mlx's quantized_matmul and the
float32 product through the BLAS, per weight shape and row count, in GB/s of weight bytes
read, beside this machine's DRAM read rate measured in the same run.

    python scripts/bench_kernels.py
    python scripts/bench_kernels.py --shapes 4096x4096 --rows 1,8 --bits 8 --group-size 64
    python scripts/bench_kernels.py --threads 1
    python scripts/bench_kernels.py --decode-only --tokens 128 --reps 3
    python scripts/bench_kernels.py --cpu-time --threads 1
    OPENBLAS_NUM_THREADS=1 python scripts/bench_kernels.py --cpu-time --threads 1 --panel-off-too \
        --shapes 576x576,1536x576,576x1536,49152x576 --rows 1,8,16,32,64,256
    python scripts/bench_kernels.py --prefill-only --prefill-tokens 1500 --cpu-time --threads 1

--cpu-time times the products in CPU seconds of this process instead of wall seconds
(with --threads 1: the kernels' work per call, which a shared, oversubscribed box does
not inflate the way it inflates wall time; GB/s then means bytes per CPU second).

--panel-off-too adds, per ISA, the kernels with their many-row (panel) path switched off:
calls of every row count on the few-row kernels, as before the panel path (same bits).
--panel-min-rows sets the row count from which the kernels take the panel path.
--dequant-too adds mx.dequantize + the float32 product through the BLAS.
--int8-too adds, per ISA, the kernels' int8-activation path (GMLX_CPU_QUANT_ACTIVATIONS=int8:
x quantized per 32 inputs, integer dots) beside the float path, with float32 and with float16
scales and biases (0.75 and 0.625 bytes a weight):
    OPENBLAS_NUM_THREADS=1 python scripts/bench_kernels.py --cpu-time --threads 1 --int8-too

--quads-too adds the int8 path over the one-stream quad layout gmlx keeps such weights in
(GMLX_CPU_QUAD_LAYOUT: per 4 outputs and 128 inputs the weights, then float16 scales and biases;
the same bits), in GB/s of its own bytes:
    python scripts/bench_kernels.py --quads-too --shapes 576x576,960x576,3072x576,576x1536 --rows 1,2,4

--many-rows-off-too (with --quads-too) adds the quads with the 4-bit many-row kernel switched off
(int8_many_rows.cpp, AVX2 without VNNI): every row count on the four-row walks (same bits):
    python scripts/bench_kernels.py --quads-too --many-rows-off-too --shapes 576x576,3072x576,576x1536 --rows 16,32,256

--panels-too adds the float32 product over panels (GMLX_CPU_FLOAT_KERNELS: per 64 outputs the
inputs' weights side by side, one fma chain per output), in GB/s of the float32 bytes:
    python scripts/bench_kernels.py --panels-too --shapes 576x576,1536x576,576x1536,49152x576 --rows 1,2,4

--prefill-tokens N (--prefill-only: only this) times a real model's prefill (--model,
default smollm2 at its 4-bit weights through the kernels): a direct forward of an N-token
prompt (random token ids, fixed seed) in --chunk-tokens chunks on an mlx-lm KV cache, then
the last position's logits, with the panel path on and off, alternating, best of --reps.

--decode adds (and --decode-only runs only) plain greedy decoding through gmlx's engine,
width 1, of a random-weight llama of SmolLM2-135M's shape (576 hidden, 30 layers, tied
49152-token embeddings) quantized to 4 bits, group 32 (the layout a GGUF Q4_1 arrives
in), with the kernels on and off (GMLX_CPU_KERNELS), the two models' runs alternating
in one process; tok/s after the first token and weight bytes read per second against
the DRAM rate measured between the runs.

Shapes are outputs x inputs (an nn.Linear weight). Each measurement evaluates one product
on each of several copies of the weights (at least --min-bytes in all, beyond the
caches) in one mx.eval, best of --reps, so every call reads its weights from DRAM and
the per-eval overhead is shared. Quantized bytes count the packed weights plus the float32
scales and biases (gmlx keeps them float32 on CPU). Both of the kernels' instruction sets
run where the CPU has them (GMLX_CPU_KERNELS_ISA forces one in gmlx itself). The DRAM rate
is the kernels' own threaded read of a 512 MiB buffer, measured before every shape.
Prints a markdown table and one JSON line.
"""

import argparse
import contextlib
import json
import platform
import time

from gmlx.platform.blas import ensure_fast_blas  # noqa: E402

ensure_fast_blas()  # the fast BLAS before mlx is first imported
import mlx.core as mx
from mlx.utils import tree_flatten

from gmlx import config
from gmlx.platform import cpu_kernels
from gmlx.platform.cpu_float import pack_panels
from gmlx.platform.memory import move_to_huge_pages
from gmlx.platform.timing import best_of_s


def parse_shape(text: str) -> tuple[int, int]:
    num_outputs, num_inputs = (int(v) for v in text.lower().split("x"))
    return num_outputs, num_inputs


CLOCK = time.perf_counter  # time.process_time with --cpu-time


def best_time_s(make_outputs, reps: int) -> float:
    return best_of_s(lambda: mx.eval(make_outputs()), reps, clock=CLOCK)


NEVER = 1 << 30  # a switch point (panel_min_rows, many_rows_min) no call reaches: the kernels below it


@contextlib.contextmanager
def kernel_setting(name: str, value):
    """One of the extension's settings (read by `name()`, written by `set_name(value)`: tile_layout,
    panel_min_rows, many_rows_min, ...) for a block, restored after it."""
    ext = cpu_kernels.extension()
    was = getattr(ext, name)()
    getattr(ext, f"set_{name}")(value)
    try:
        yield
    finally:
        getattr(ext, f"set_{name}")(was)


def is_tiles_for(isa: str) -> bool:
    """The layout the engine packs for this ISA: tiles where the default is tiles and the ISA is
    AVX-512 (the tiles' fast path needs VNNI), quads under any other forced ISA."""
    return cpu_kernels.extension().tile_layout() and isa == "avx512"


def pack_one_stream(half_copies, group_size: int, bits: int, is_tiles: bool) -> list:
    with kernel_setting("tile_layout", is_tiles):  # evaluated inside: a lazy pack would read the setting later
        copies = [cpu_kernels.pack_quads(w, s, b, group_size, bits) for w, s, b in half_copies]
        mx.eval(copies)
    return copies


def measure_shape(num_outputs, num_inputs, num_rows_list, bits, group_size, min_bytes, reps, isas,
                  panel_off_too=False, dequant_too=False, int8_too=False, quads_too=False, panels_too=False,
                  many_rows_off_too=False):
    weight = mx.random.normal((num_outputs, num_inputs), key=mx.random.key(0))  # (N, K)
    packed = mx.quantize(weight, group_size=group_size, bits=bits)
    quantized_bytes = sum(a.nbytes for a in packed)
    float_bytes = weight.nbytes
    num_copies = max(2, -(-min_bytes // quantized_bytes))
    # Distinct copies (x + 0 would alias): perturb each so MLX keeps them apart.
    q_copies = [(packed[0] + 0 * i, packed[1] + i * 1e-9, packed[2]) for i in range(num_copies)]
    num_float_copies = max(2, -(-min_bytes // float_bytes))
    f_copies = [weight + i * 1e-9 for i in range(num_float_copies)]
    # float16 scales and biases, as int8-activation modules keep a GGUF's (timing only: mx.quantize's
    # float32 scales round here, a GGUF's Q4_1 ones are exact).
    int8_too = int8_too or quads_too
    half_copies = [(w, s.astype(mx.float16), b.astype(mx.float16)) for w, s, b in q_copies] if int8_too else []
    half_bytes = sum(a.nbytes for a in half_copies[0]) if int8_too else 0
    # The same weights in the one-stream layout gmlx keeps them in (GMLX_CPU_QUAD_LAYOUT), per
    # ISA: tiles where the engine would run them (AVX-512 VNNI), quads under a forced ISA.
    quad_copies = {isa: pack_one_stream(half_copies, group_size, bits, is_tiles_for(isa))
                   for isa in isas} if quads_too else {}
    quad_bytes = {isa: copies[0].nbytes for isa, copies in quad_copies.items()}
    # The float32 weights as gmlx keeps them with GMLX_CPU_FLOAT_KERNELS (the same bytes).
    panel_copies = [pack_panels(w) for w in f_copies] if panels_too else []
    mx.eval(q_copies, f_copies, half_copies, quad_copies, panel_copies)
    if config.is_huge_pages_enabled():  # where the engine keeps its weights (GMLX_HUGE_PAGES)
        move_to_huge_pages([a for _, a in tree_flatten([q_copies, f_copies, half_copies,
                                                          list(quad_copies.values()), panel_copies])])
    ext = cpu_kernels.extension()
    rows = []
    for num_rows in num_rows_list:
        x = mx.random.normal((num_rows, num_inputs), key=mx.random.key(num_rows))  # (M, K)
        mx.eval(x)
        row = {"shape": f"{num_outputs}x{num_inputs}", "rows": num_rows}
        for isa in isas:
            ext.set_isa(isa)
            t = best_time_s(lambda: [cpu_kernels.quantized_matmul(x, w, s, b, group_size, bits)
                                     for w, s, b in q_copies], reps) / num_copies
            row[f"gmlx_{isa}_ms"], row[f"gmlx_{isa}_gbs"] = 1e3 * t, quantized_bytes / t / 1e9
            if int8_too:
                t = best_time_s(lambda: [cpu_kernels.quantized_matmul(x, w, s, b, group_size, bits, True)
                                         for w, s, b in q_copies], reps) / num_copies
                row[f"int8_{isa}_ms"], row[f"int8_{isa}_gbs"] = 1e3 * t, quantized_bytes / t / 1e9
                t = best_time_s(lambda: [cpu_kernels.quantized_matmul(x, w, s, b, group_size, bits, True)
                                         for w, s, b in half_copies], reps) / num_copies
                row[f"int8_half_{isa}_ms"], row[f"int8_half_{isa}_gbs"] = 1e3 * t, half_bytes / t / 1e9
            if quads_too:
                def quads_s() -> float:  # kernels read a layout under its own setting
                    with kernel_setting("tile_layout", is_tiles_for(isa)):
                        return best_time_s(lambda: [cpu_kernels.quantized_matmul_quads(x, q, num_outputs, bits)
                                                    for q in quad_copies[isa]], reps) / num_copies

                t = quads_s()
                row[f"quads_{isa}_ms"], row[f"quads_{isa}_gbs"] = 1e3 * t, quad_bytes[isa] / t / 1e9
                if many_rows_off_too:
                    with kernel_setting("many_rows_min", NEVER):
                        row[f"walks_{isa}_ms"] = 1e3 * quads_s()
            if panel_off_too:
                with kernel_setting("panel_min_rows", NEVER):
                    t = best_time_s(lambda: [cpu_kernels.quantized_matmul(x, w, s, b, group_size, bits)
                                             for w, s, b in q_copies], reps) / num_copies
                row[f"few_row_{isa}_ms"] = 1e3 * t
        if dequant_too:
            t = best_time_s(lambda: [x @ mx.dequantize(w, s, b, group_size=group_size, bits=bits).T
                                     for w, s, b in q_copies], reps) / num_copies
            row["dequant_fp32_ms"] = 1e3 * t
        t = best_time_s(lambda: [mx.quantized_matmul(x, w, s, b, transpose=True, group_size=group_size, bits=bits)
                                 for w, s, b in q_copies], reps) / num_copies
        row["mlx_ms"], row["mlx_gbs"] = 1e3 * t, quantized_bytes / t / 1e9
        t = best_time_s(lambda: [x @ w.T for w in f_copies], reps) / num_float_copies
        row["fp32_ms"], row["fp32_gbs"] = 1e3 * t, float_bytes / t / 1e9
        if panels_too:  # AVX2 on every AVX2 CPU (the same chains as AVX-512 would run)
            t = best_time_s(lambda: [cpu_kernels.float_matmul(x, p, num_outputs) for p in panel_copies],
                            reps) / num_float_copies
            row["panels_ms"], row["panels_gbs"] = 1e3 * t, float_bytes / t / 1e9
        rows.append(row)
    return rows


SMOLLM2_135M_SHAPE = dict(hidden_size=576, num_hidden_layers=30, intermediate_size=1536, num_attention_heads=9,
                          num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                          max_position_embeddings=2048, rope_theta=100000.0, rms_norm_eps=1e-5)


def make_quantized_smollm2_shape(folder, bits: int, group_size: int):
    """A random llama of SmolLM2-135M's shape, quantized, saved as an mlx-lm folder."""
    import shutil
    from pathlib import Path

    import mlx.nn as nn
    from mlx_lm.models import llama

    from gmlx.config import BUILTIN_TARGET_DIR

    folder = Path(folder)
    mx.random.seed(0)
    config = dict(model_type="llama", **SMOLLM2_135M_SHAPE)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    nn.quantize(model, group_size=group_size, bits=bits)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config["quantization"] = {"group_size": group_size, "bits": bits}
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (BUILTIN_TARGET_DIR / name).exists():
            shutil.copy(BUILTIN_TARGET_DIR / name, folder / name)


def decode_tok_per_s(engine, num_tokens: int) -> tuple[float, list[int]]:
    from gmlx.request import SamplingParams

    engine.add_request([1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=num_tokens))
    tokens, first_at, reason = [], None, None
    while reason is None:
        for output in engine.step():
            tokens.extend(output.new_token_ids)
            reason = output.finish_reason
        if first_at is None and tokens:
            first_at = time.perf_counter()
    return (len(tokens) - 1) / (time.perf_counter() - first_at), tokens


def measure_decode(bits, group_size, num_tokens, reps) -> dict:
    import tempfile

    from gmlx.config import EngineConfig, env_overrides
    from gmlx.engine import Engine
    from gmlx.models.loader import load_model

    with tempfile.TemporaryDirectory() as folder:
        make_quantized_smollm2_shape(folder, bits, group_size)
        engines = {}
        for mode, flag in (("kernels", "1"), ("mlx", "0")):
            with env_overrides({"GMLX_CPU_KERNELS": flag}):
                target = load_model(folder)
            engines[mode] = Engine(target, None, EngineConfig(prompt_cache_bytes=0))
        weight_bytes = sum(v.nbytes for _, v in tree_flatten_params(engines["kernels"].target.model))
    rates = {mode: [] for mode in engines}
    tokens, dram = {}, []
    for _ in range(reps):
        for mode, engine in engines.items():
            rate, tokens[mode] = decode_tok_per_s(engine, num_tokens)
            rates[mode].append(rate)
        dram.append(cpu_kernels.read_bandwidth_gbs(512 << 20, 3))
    best = {mode: max(r) for mode, r in rates.items()}
    return {"tok_per_s": best, "all_tok_per_s": rates, "weight_bytes": weight_bytes, "dram_gbs": max(dram),
            "num_tokens": {m: len(t) for m, t in tokens.items()}, "same_tokens": tokens["kernels"] == tokens["mlx"]}


def measure_prefill(model, num_tokens: int, chunk_tokens: int, reps: int) -> dict:
    """Seconds to prefill a num_tokens prompt in chunk_tokens chunks, panel path on and off."""
    from mlx_lm.models.cache import make_prompt_cache

    from gmlx.config import env_overrides
    from gmlx.models.loader import load_model

    with env_overrides({"GMLX_CPU_KERNELS": "1", "GMLX_CPU_COMPUTE_FORMAT": "quantized"}):
        target = load_model(model)
    prompt = mx.random.randint(0, target.vocab_size, (1, num_tokens), key=mx.random.key(0))  # (1, T)
    ext = cpu_kernels.extension()
    default_min_rows = ext.panel_min_rows()

    def prefill() -> tuple[float, mx.array]:
        cache = make_prompt_cache(target.model)
        start = CLOCK()
        for begin in range(0, num_tokens, chunk_tokens):
            hidden = target.body(prompt[:, begin : begin + chunk_tokens], cache)  # (1, chunk, D)
            mx.eval(hidden, [c.state for c in cache])
        logits = target.head(hidden[:, -1:])  # (1, 1, V)
        mx.eval(logits)
        return CLOCK() - start, logits

    seconds = {"panel": [], "few_row": []}
    logits = {}
    for _ in range(reps):
        for mode, min_rows in (("panel", default_min_rows), ("few_row", NEVER)):
            with kernel_setting("panel_min_rows", min_rows):
                elapsed, logits[mode] = prefill()
            seconds[mode].append(elapsed)
    return {"model": target.path, "num_tokens": num_tokens, "chunk_tokens": chunk_tokens,
            "num_kernel_modules": sum("Kernel" in type(m).__name__ for _, m in target.model.named_modules()),
            "seconds": seconds, "panel_min_rows": default_min_rows, "same_logits": mx.array_equal(logits["panel"], logits["few_row"]).item()}


def print_prefill(p: dict) -> None:
    best = {mode: min(v) for mode, v in p["seconds"].items()}
    print(f"\nPrefill, {p['model']}, {p['num_tokens']} tokens in {p['chunk_tokens']}-token chunks, "
          f"{p['num_kernel_modules']} kernel modules\n")
    print("| quantized products on | s (best) | all reps | tokens/s |")
    print("|---|---|---|---|")
    for label, mode in ((f"panel path (rows >= {p['panel_min_rows']})", "panel"), ("few-row kernels only (before)", "few_row")):
        reps = ", ".join(f"{v:.2f}" for v in p["seconds"][mode])
        print(f"| {label} | {best[mode]:.2f} | {reps} | {p['num_tokens'] / best[mode]:.0f} |")
    print(f"\nbefore / after: {best['few_row'] / best['panel']:.1f}x; same last-position logits: {p['same_logits']}")


def tree_flatten_params(model):
    return tree_flatten(model.parameters())


def print_decode(d: dict, bits: int, group_size: int) -> None:
    on, off = d["tok_per_s"]["kernels"], d["tok_per_s"]["mlx"]
    print(f"\nDecode, SmolLM2-135M shape, random weights, {bits}-bit group {group_size}, width 1, "
          f"{d['num_tokens']['kernels']} tokens; weights {d['weight_bytes'] / 1e6:.1f} MB; "
          f"DRAM {d['dram_gbs']:.1f} GB/s\n")
    print("| products in | tok/s (best) | all reps | weight GB/s | of DRAM |")
    print("|---|---|---|---|---|")
    for label, mode in (("gmlx kernels", "kernels"), ("mlx quantized_matmul", "mlx")):
        rate, reps = d["tok_per_s"][mode], ", ".join(f"{r:.1f}" for r in d["all_tok_per_s"][mode])
        gbs = rate * d["weight_bytes"] / 1e9
        print(f"| {label} | {rate:.1f} | {reps} | {gbs:.2f} | {gbs / d['dram_gbs']:.2f} |")
    print(f"\nkernels / mlx: {on / off:.2f}x; same greedy tokens: {d['same_tokens']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="576x576,1536x576,576x1536,4096x4096")
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--min-bytes", type=int, default=96 << 20)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="kernel threads (0: every CPU)")
    parser.add_argument("--cpu-time", action="store_true", help="time products in process CPU seconds")
    parser.add_argument("--decode", action="store_true", help="add the decode comparison")
    parser.add_argument("--decode-only", action="store_true", help="only the decode comparison")
    parser.add_argument("--tokens", type=int, default=128, help="decode tokens per run")
    parser.add_argument("--panel-off-too", action="store_true", help="add the kernels with the panel path off")
    parser.add_argument("--panel-min-rows", type=int, default=0,
                        help="rows from which the kernels take the panel path (0: the built-in default)")
    parser.add_argument("--dequant-too", action="store_true", help="add mx.dequantize + float32 product")
    parser.add_argument("--int8-too", action="store_true", help="add the int8-activation path")
    parser.add_argument("--quads-too", action="store_true",
                        help="add the int8 path over the one-stream quad layout (implies --int8-too)")
    parser.add_argument("--many-rows-off-too", action="store_true",
                        help="with --quads-too: add the quads with the many-row kernel off (four-row walks)")
    parser.add_argument("--panels-too", action="store_true",
                        help="add the float32 product over panels (GMLX_CPU_FLOAT_KERNELS) beside the BLAS's")
    parser.add_argument("--prefill-tokens", type=int, default=0, help="add a real model's prefill (0: off)")
    parser.add_argument("--prefill-only", action="store_true", help="only the prefill comparison")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="prefill chunk")
    parser.add_argument("--model", default="smollm2", help="the prefill's model")
    args = parser.parse_args()
    global CLOCK
    if args.cpu_time:
        CLOCK = time.process_time
    if not cpu_kernels.is_built():
        raise SystemExit(f"gmlx CPU kernels unavailable: {cpu_kernels.status()['reason']}")
    ext = cpu_kernels.extension()
    ext.set_num_threads(args.threads)
    ext.set_panel_min_rows(args.panel_min_rows)
    isas = {"avx512": ["avx512", "avx2"], "avx2": ["avx2"]}.get(ext.best_isa(), ["portable"])
    if args.prefill_tokens or args.prefill_only:
        prefill = measure_prefill(args.model, args.prefill_tokens or 1500, args.chunk_tokens, args.reps)
        print_prefill(prefill)
        print(json.dumps({"prefill": prefill}))
        if args.prefill_only:
            return
    if args.decode or args.decode_only:
        decode = measure_decode(args.bits, args.group_size, args.tokens, args.reps)
        print_decode(decode, args.bits, args.group_size)
        print(json.dumps({"decode": decode}))
        if args.decode_only:
            return
    results, dram = [], []
    for shape in args.shapes.split(","):
        dram.append(cpu_kernels.read_bandwidth_gbs(512 << 20, 5))
        results += measure_shape(*parse_shape(shape), [int(r) for r in args.rows.split(",")], args.bits,
                                 args.group_size, args.min_bytes, args.reps, isas, args.panel_off_too,
                                 args.dequant_too, args.int8_too, args.quads_too, args.panels_too,
                                 args.quads_too and args.many_rows_off_too)
    ext.set_isa(ext.best_isa())
    dram_gbs = max(dram)
    print(f"CPU: {platform.processor() or platform.machine()}, {ext.num_threads()} kernel threads; "
          f"{'CPU' if args.cpu_time else 'wall'} time; "
          f"{args.bits}-bit, group {args.group_size}; DRAM read {dram_gbs:.1f} GB/s "
          f"(per shape: {', '.join(f'{d:.1f}' for d in dram)})\n")
    header = ["shape (out x in)", "rows"] + [f"gmlx {isa} ms (GB/s, of DRAM)" for isa in isas]
    is_int8 = args.int8_too or args.quads_too
    if is_int8:
        header += [f"int8 x {isa} ms (GB/s, of DRAM)" for isa in isas] + [f"int8 / float {isa}" for isa in isas]
        header += [f"int8 x, f16 scales {isa} ms (GB/s)" for isa in isas]
    if args.quads_too:
        header += [f"int8 x, quad layout {isa} ms (GB/s, of DRAM)" for isa in isas]
        header += [f"quads / f16 rows {isa}" for isa in isas]
        if args.many_rows_off_too:
            header += [f"quads, walks only {isa} ms" for isa in isas] + [f"walks / default {isa}" for isa in isas]
    if args.panel_off_too:
        header += [f"few-row only {isa} ms" for isa in isas]
    if args.dequant_too:
        header += ["dequantize + fp32 ms"]
    header += ["mlx qmm ms (GB/s)", "fp32 BLAS ms (GB/s)", "gmlx / mlx", "gmlx / fp32"]
    if args.panels_too:
        header += ["fp32 panels ms (GB/s, of DRAM)", "panels / BLAS"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    best = isas[0]
    for r in results:
        cells = [r["shape"], str(r["rows"])]
        cells += [f"{r[f'gmlx_{isa}_ms']:.3f} ({r[f'gmlx_{isa}_gbs']:.1f}, {r[f'gmlx_{isa}_gbs'] / dram_gbs:.2f})"
                  for isa in isas]
        if is_int8:
            cells += [f"{r[f'int8_{isa}_ms']:.3f} ({r[f'int8_{isa}_gbs']:.1f}, {r[f'int8_{isa}_gbs'] / dram_gbs:.2f})"
                      for isa in isas]
            cells += [f"{r[f'gmlx_{isa}_ms'] / r[f'int8_{isa}_ms']:.2f}x" for isa in isas]
            cells += [f"{r[f'int8_half_{isa}_ms']:.3f} ({r[f'int8_half_{isa}_gbs']:.1f})" for isa in isas]
        if args.quads_too:
            cells += [f"{r[f'quads_{isa}_ms']:.3f} ({r[f'quads_{isa}_gbs']:.1f}, {r[f'quads_{isa}_gbs'] / dram_gbs:.2f})"
                      for isa in isas]
            cells += [f"{r[f'int8_half_{isa}_ms'] / r[f'quads_{isa}_ms']:.2f}x" for isa in isas]
            if args.many_rows_off_too:
                cells += [f"{r[f'walks_{isa}_ms']:.3f}" for isa in isas]
                cells += [f"{r[f'walks_{isa}_ms'] / r[f'quads_{isa}_ms']:.2f}x" for isa in isas]
        if args.panel_off_too:
            cells += [f"{r[f'few_row_{isa}_ms']:.3f}" for isa in isas]
        if args.dequant_too:
            cells += [f"{r['dequant_fp32_ms']:.3f}"]
        cells += [f"{r['mlx_ms']:.3f} ({r['mlx_gbs']:.2f})", f"{r['fp32_ms']:.3f} ({r['fp32_gbs']:.1f})",
                  f"{r['mlx_ms'] / r[f'gmlx_{best}_ms']:.1f}x", f"{r['fp32_ms'] / r[f'gmlx_{best}_ms']:.2f}x"]
        if args.panels_too:
            cells += [f"{r['panels_ms']:.3f} ({r['panels_gbs']:.1f}, {r['panels_gbs'] / dram_gbs:.2f})",
                      f"{r['fp32_ms'] / r['panels_ms']:.2f}x"]
        print("| " + " | ".join(cells) + " |")
    print(json.dumps({"dram_gbs": dram_gbs, "threads": ext.num_threads(), "bits": args.bits, "cpu_time": args.cpu_time,
                      "group_size": args.group_size, "results": results}))


if __name__ == "__main__":
    main()
