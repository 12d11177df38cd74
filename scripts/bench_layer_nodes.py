"""A model's fused llama (or qwen3) layers as one graph node a step, one a layer, or six a layer, side by
side in one process.

The forms give the same bits (tests/test_cpu_layers.py); the form is read when the body and
each fused layer are called, so one loaded model serves all and the flags flip before each timed
run (scripts/ab.py's ABBA turns, medians of per-rep ratios). Per compute format of the model
(SmolLM2 by default, 4-bit and float32; the built-in model is float32): greedy decode tok/s
(--tokens), the Python thread's CPU per decode step
(mlx's dispatch of each node runs on it, and on two cores it shares a core with the kernels'
second thread), and a forward of 1-4 positions at 160 KV tokens (best of 10) with the
positions' cost over one (the verify cost of issue 17).

    PYTHONPATH=. python3 scripts/bench_layer_nodes.py --reps 10
    PYTHONPATH=. python3 scripts/bench_layer_nodes.py --formats quantized --reps 16 --tokens 128
    PYTHONPATH=. python3 scripts/bench_layer_nodes.py --model builtin --formats float32 --reps 10
    GMLX_CPU_LAYER_STACK=1 is needed (the default): the script flips the forms itself.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this tree's gmlx
sys.path.insert(0, str(ROOT / "scripts"))

import bench_decode_ops  # noqa: E402  (sets the BLAS up before mlx)

from ab import alternate, median_ratio  # noqa: E402
from bench_compute_format import gmlx_tok_per_s  # noqa: E402
from gmlx.config import EngineConfig, env_overrides  # noqa: E402
from gmlx.engine import Engine  # noqa: E402
from gmlx.models.source import resolve_model_path  # noqa: E402
from gmlx.platform.cpu_layers import FusedLlamaBlock, FusedQwen3Block  # noqa: E402
from gmlx.platform.timing import best_of_s  # noqa: E402

FORMS = ("a node a step", "a node a layer", "six a layer")
POSITIONS = (1, 2, 3, 4)


def bench_format(model: str, compute_format: str, num_reps: int, num_tokens: int) -> None:
    model_path = resolve_model_path(None if model == "builtin" else model)
    with env_overrides({"GMLX_CPU_COMPUTE_FORMAT": compute_format}):
        engine = Engine.load(EngineConfig(model_path=str(model_path), prompt_cache_bytes=0))
    calls = [layer._layer_call for layer in engine.target.model.model.layers
             if type(layer) in (FusedLlamaBlock, FusedQwen3Block)]
    body = engine.target.model.model
    stack_call = body.__dict__.get("_stack_call")
    if not calls or not all(call.is_one_node for call in calls) or stack_call is None:
        sys.exit(f"{model}'s layers are not fused as one node a step here (kernels not built, or a switch is off)")
    forwards = bench_decode_ops.verify_forwards(engine.target, POSITIONS)

    def set_form(form: str) -> None:
        object.__setattr__(body, "_stack_call", stack_call if form == FORMS[0] else None)
        for call in calls:
            call.is_one_node = form != FORMS[2]

    def run(form: str) -> dict[str, float]:
        set_form(form)
        cpu_before, steps_before = time.thread_time(), engine.counters["num_rounds"]
        result = {"decode tok/s": gmlx_tok_per_s(engine, num_tokens)}
        num_steps = engine.counters["num_rounds"] - steps_before
        result["Python thread CPU ms a step"] = 1e3 * (time.thread_time() - cpu_before) / max(num_steps, 1)
        result.update({f"forward {n} ms": 1e3 * best_of_s(fn, 10) for n, fn in forwards.items()})
        return result

    try:
        runs = alternate(FORMS, num_reps, run)
    finally:
        set_form(FORMS[0])
    print(f"\n{model} {compute_format}, {num_reps} ABC-CBA reps, {num_tokens} tokens; speeds are medians of "
          "per-rep ratios")
    print(f"| measure | {' | '.join(FORMS)} | a step's node over a layer's | a layer's node over six |")
    print("|---|---|---|---|---|---|")
    for key in runs[FORMS[0]][0]:
        values = [[r[key] for r in runs[form]] for form in FORMS]

        def speed(fast, slow):
            return median_ratio(zip(fast, slow) if key.endswith("tok/s") else zip(slow, fast))

        medians = " | ".join(f"{statistics.median(v):.2f}" for v in values)
        print(f"| {key} | {medians} | {speed(values[0], values[1]):.3f}x | {speed(values[1], values[2]):.3f}x |")
    for form in FORMS:
        over = " / ".join(f"{median_ratio((r[f'forward {n} ms'], r['forward 1 ms']) for r in runs[form]):.2f}"
                          for n in POSITIONS[1:])
        print(f"{form}: {'/'.join(map(str, POSITIONS[1:]))} positions over 1 (median of per-rep ratios): {over}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (default), builtin, or a model path")
    parser.add_argument("--formats", default="quantized,float32", help="GMLX_CPU_COMPUTE_FORMAT values, comma-separated")
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    print(f"{platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for compute_format in args.formats.split(","):
        bench_format(args.model, compute_format, args.reps, args.tokens)


if __name__ == "__main__":
    main()
