"""A quantized model's width-1 CPU decode with gmlx's fused decode ops (RMSNorm, RoPE,
attention: GMLX_CPU_DECODE_OPS) off and on, side by side in one run. Both engines run the
quantized products in gmlx's kernels. Reported per side: engine decode tok/s (median of
--repeats greedy runs of --tokens, alternating), MLX graph nodes of one decode step, the
step's time against the products' alone (the same 4-bit products evaluated back to back),
and the forward cost of 1-4 positions at --context tokens of KV (verify widths k+1),
best of --reps each.

    OPENBLAS_NUM_THREADS=1 python3 scripts/bench_decode_ops.py                 # smollm2, 128 tokens
    python3 scripts/bench_decode_ops.py --model FILE.gguf --tokens 64 --repeats 5 --json
    OPENBLAS_NUM_THREADS=1 GMLX_CPU_KERNELS_THREADS=1 python3 scripts/bench_decode_ops.py --cpu-time

--compare activations instead puts GMLX_CPU_QUANT_ACTIVATIONS=float and =int8 side by side (both
with the fused ops on): the 4-bit products with float32 activations, and with activations
quantized to int8 per 32 inputs (integer dots):

    OPENBLAS_NUM_THREADS=1 GMLX_CPU_KERNELS_THREADS=1 python3 scripts/bench_decode_ops.py --compare activations --cpu-time

--compare layout puts the int8 path's weights in mlx's rows (GMLX_CPU_QUAD_LAYOUT=0: one node per
product) beside the one-stream quad layout (q/k/v and gate/up grouped), same bits:

    python3 scripts/bench_decode_ops.py --compare layout

--compare fused puts a llama layer's ~20 nodes (GMLX_CPU_FUSED_LAYERS=0) beside its four fused
kernel nodes (gmlx/platform/cpu_layers.py), same bits.

--cpu-time times the forwards and products in process CPU seconds (with one kernel and one
BLAS thread: the work per step, which an oversubscribed box does not inflate the way it
inflates wall time); the engine's tok/s stays wall time.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's gmlx

from gmlx.platform.blas import ensure_fast_blas  # noqa: E402

ensure_fast_blas()  # the fast BLAS before mlx is first imported
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from bench_compute_format import gmlx_tok_per_s  # noqa: E402
from gmlx.cache.ragged import make_ragged_cache  # noqa: E402
from gmlx.config import EngineConfig, env_overrides  # noqa: E402
from gmlx.engine import Engine  # noqa: E402
from gmlx.models.source import resolve_model_path  # noqa: E402
from gmlx.platform.cpu_quantized import input_dims  # noqa: E402
from gmlx.platform.timing import best_of_s  # noqa: E402

# What each comparison loads per side (GMLX_* overrides on top of the quantized format).
COMPARISONS = {
    "decode-ops": {"ops off": {"GMLX_CPU_DECODE_OPS": "0"}, "ops on": {"GMLX_CPU_DECODE_OPS": "1"}},
    "activations": {"float x": {"GMLX_CPU_QUANT_ACTIVATIONS": "float"},
                    "int8 x": {"GMLX_CPU_QUANT_ACTIVATIONS": "int8"}},
    "layout": {"row layout": {"GMLX_CPU_QUAD_LAYOUT": "0"},
               "quad layout": {"GMLX_CPU_QUAD_LAYOUT": "1", "GMLX_CPU_FUSED_LAYERS": "0"}},
    "fused": {"layers apart": {"GMLX_CPU_FUSED_LAYERS": "0"}, "fused layers": {"GMLX_CPU_FUSED_LAYERS": "1"}},
}
MAX_POSITIONS = 4


CLOCK = time.perf_counter  # time.process_time with --cpu-time


def verify_forwards(target, positions, num_kv_tokens: int = 160) -> dict:
    """num_positions -> a forward_fn of that many positions over one cache prefilled with
    num_kv_tokens tokens (a verify's shape; each forward trims its positions after)."""
    cache = prefilled_cache(target, 1, num_kv_tokens)
    return {n: forward_fn(target, cache, n) for n in positions}


def batch_forwards(target, widths, num_kv_tokens: int = 160) -> dict:
    """num_rows -> a forward_fn of one position for each of that many rows, each row's cache
    prefilled with num_kv_tokens tokens (a wide plain decode step's shape)."""
    return {n: forward_fn(target, prefilled_cache(target, n, num_kv_tokens), 1, n) for n in widths}


def prefilled_cache(target, num_rows: int, num_kv_tokens: int):
    """A ragged cache of num_rows rows, each holding the same num_kv_tokens tokens."""
    cache = make_ragged_cache(target.num_layers, num_rows, stored_dtype=target.kv_dtype)
    prompt = mx.array([[(11 * i) % 1000 + 5 for i in range(num_kv_tokens)]] * num_rows)
    mx.eval(target.forward(prompt, cache)[1])
    return cache


def forward_fn(target, cache, num_positions: int, num_rows: int = 1):
    tokens = mx.array([[7] * num_positions] * num_rows)  # (B, T)

    def run():
        _, logits = target.forward(tokens, cache)
        mx.eval(logits)
        for layer in cache:
            layer.trim(num_positions)

    return run


def products_fn(target):
    """Every quantized product of one decode step, on random rows, in one eval."""
    modules = [m for m in target.model.modules() if isinstance(m, nn.QuantizedLinear)]
    inputs = {}
    for m in modules:
        inputs.setdefault(input_dims(m), mx.random.normal((1, 1, input_dims(m))))
    embed = target.body.embed_tokens
    head_input = mx.random.normal((1, 1, target.hidden_size))
    mx.eval(list(inputs.values()), head_input)

    def run():
        outs = [m(inputs[input_dims(m)]) for m in modules]
        if isinstance(embed, nn.QuantizedEmbedding):
            outs.append(embed.as_linear(head_input))
        mx.eval(outs)

    return run


def num_graph_nodes(target, cache) -> int:
    _, logits = target.forward(mx.array([[7]]), cache)
    with tempfile.NamedTemporaryFile(suffix=".dot") as dot:
        mx.export_to_dot(dot.name, logits)
        text = Path(dot.name).read_text()
    for layer in cache:
        layer.trim(1)
    return text.count("shape=rectangle")  # one per primitive; arrays are plain nodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--context", type=int, default=160, help="KV tokens behind the verify-cost forwards")
    parser.add_argument("--reps", type=int, default=20, help="forwards per verify-cost measurement (best of)")
    parser.add_argument("--cpu-time", action="store_true", help="time forwards in process CPU seconds")
    parser.add_argument("--compare", choices=sorted(COMPARISONS), default="decode-ops")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sides = COMPARISONS[args.compare]
    if args.cpu_time:
        global CLOCK
        CLOCK = time.process_time
    source = resolve_model_path(args.model)

    engines = {}
    for side, overrides in sides.items():
        with env_overrides({"GMLX_CPU_COMPUTE_FORMAT": "quantized", **overrides}):
            engines[side] = Engine.load(EngineConfig(model_path=str(source), prompt_cache_bytes=0))
    caches = {}
    for side, engine in engines.items():
        target = engine.target
        caches[side] = make_ragged_cache(target.num_layers, stored_dtype=target.kv_dtype)
        mx.eval(target.forward(mx.array([[(11 * i) % 1000 + 5 for i in range(args.context)]]), caches[side])[1])
        gmlx_tok_per_s(engine, 16)  # warm-up: touch every weight once

    tok_per_s = {side: [] for side in engines}
    for _ in range(args.repeats):
        for side, engine in engines.items():
            tok_per_s[side].append(gmlx_tok_per_s(engine, args.tokens))
    forward_ms = {side: {} for side in engines}
    for num_positions in range(1, MAX_POSITIONS + 1):  # alternating sides per width
        for side, engine in engines.items():
            run = forward_fn(engine.target, caches[side], num_positions)
            forward_ms[side][num_positions] = 1e3 * best_of_s(run, args.reps, clock=CLOCK)
    products_ms = {side: 1e3 * best_of_s(products_fn(e.target), args.reps, clock=CLOCK) for side, e in engines.items()}
    nodes = {side: num_graph_nodes(e.target, caches[side]) for side, e in engines.items()}

    report = {
        "model": str(source), "clock": CLOCK.__name__, "tokens": args.tokens, "repeats": args.repeats, "context": args.context,
        "cpu": platform.processor() or platform.machine(),
        "tok_per_s": {side: statistics.median(v) for side, v in tok_per_s.items()},
        "graph_nodes_per_step": nodes, "products_ms": products_ms, "forward_ms": forward_ms,
        "verify_cost": {side: {k: ms / v[1] for k, ms in v.items()} for side, v in forward_ms.items()},
    }
    if args.json:
        print(json.dumps(report))
        return
    print(f"{source.name}, 4-bit kernels, width 1, {args.tokens} tokens, median of {args.repeats}; "
          f"forwards at {args.context} KV tokens, best of {args.reps} ({CLOCK.__name__})")
    print("| side | tok/s | nodes/step | 1-pos forward ms | products ms | 2/3/4 pos over 1 |")
    print("|---|---|---|---|---|---|")
    for side in engines:
        cost = report["verify_cost"][side]
        print(f"| {side} | {report['tok_per_s'][side]:.1f} | {nodes[side]} | {forward_ms[side][1]:.2f} | "
              f"{products_ms[side]:.2f} | {cost[2]:.2f} / {cost[3]:.2f} / {cost[4]:.2f} |")
    first, second = list(sides)
    ratio = report["tok_per_s"][second] / report["tok_per_s"][first]
    print(f"decode tok/s, {second} over {first}: {ratio:.2f}x; "
          f"1-position forward {forward_ms[first][1] / forward_ms[second][1]:.2f}x, "
          f"products {products_ms[first] / products_ms[second]:.2f}x less time")


if __name__ == "__main__":
    main()
