"""Decode speed with and without gmlx's one-row sgemm interposer, side by side.

The BLAS and the interposer load when gmlx is imported, so every measurement runs in
its own subprocess (GMLX_SGEMV_INTERPOSER=1 or 0), alternating on/off across reps.
Decoding is mlx_lm's plain `generate_step` loop, greedy, width 1, on the model as gmlx loads
it on CPU: compiled norm/rope (GMLX_FUSE_CPU_OPS=0: without) and, where the interposer routes
that layout, Linear weights stored input-major (GMLX_INPUT_MAJOR_WEIGHTS=0: mlx-lm's): no
engine code. --fusion-ab and --layout-ab add an interposer-on run without the one or the other.
With --in-process every mode's model lives in one process and the modes take turns each
rep, "off" being the interposer's routing switched off: on this shared box, runs of a few
seconds in separate processes differ by +-15%, which hides a 10% effect.

    python scripts/bench_blas.py                         # the built-in model
    python scripts/bench_blas.py --model PATH            # any mlx-lm model folder
    python scripts/bench_blas.py --random-params 120M    # random-weight float32 qwen3, ~120M params
    python scripts/bench_blas.py --random-params 120M --tokens 48 --reps 3
    python scripts/bench_blas.py --random-params 120M --in-process --reps 8 --layout-ab --fusion-ab

Prints a markdown table and one JSON line: tokens/s with the interposer on and off and
their ratio, whether both produced the same tokens, and the weight bytes read per second
while decoding (weight bytes per token x tokens/s) as a fraction of this machine's DRAM
read rate, measured here as the best of a numpy sum and an OpenBLAS sgemv over 1 GiB,
once beside every on/off pair of runs (the rate moves within minutes on a shared box).
The CPU may be shared: compare the ratios, which are measured in the same run.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from ab import alternate, median_ratio_of

from gmlx.platform.timing import best_of_s

DEFAULT_MODEL = "builtin"


def parse_count(text: str) -> int:
    scale = {"K": 1e3, "M": 1e6, "G": 1e9}.get(text[-1:].upper(), 1)
    return int(float(text[:-1] if scale != 1 else text) * scale)


def make_random_qwen3(num_params: int):
    """A float32 qwen3 of about num_params parameters, from ModelArgs (no download)."""
    import mlx.core as mx

    from gmlx.models.random_model import make_random_model, qwen3_config

    config = qwen3_config(num_params)
    model = make_random_model(config)
    prompt = mx.random.randint(0, config["vocab_size"], (32,))
    return model, prompt, (f"random qwen3, {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
                           "float32")


def load_folder(path: str):
    import mlx.core as mx
    from mlx_lm import load

    from gmlx.config import BUILTIN_TARGET_DIR

    folder = str(BUILTIN_TARGET_DIR) if path == DEFAULT_MODEL else path
    if not os.path.exists(os.path.join(folder, "config.json")):
        raise SystemExit(f"no model at {folder} (the built-in model may not be trained yet; "
                         "try --random-params 120M)")
    model, tokenizer = load(folder)
    # float32 as gmlx runs it: float16 weights (the built-in model's on-disk dtype) would
    # bypass BLAS on MLX's CPU backend, and so the interposer, entirely.
    model.set_dtype(mx.float32)
    prompt = mx.array(tokenizer.encode("import os\nimport sys\n\n\ndef main(argv):\n    "))
    return model, prompt, f"{folder} (float32)"


def weight_bytes_per_token(model) -> tuple[int, int]:
    """(all parameter bytes, bytes one decode step reads): an untied input embedding
    contributes one row, not the table."""
    from mlx.utils import tree_flatten

    params = dict(tree_flatten(model.parameters()))
    total = sum(v.nbytes for v in params.values())
    untied = [k for k in params if k.endswith("embed_tokens.weight")] if any(
        k.startswith("lm_head") for k in params) else []
    return total, total - sum(params[k].nbytes for k in untied)


def products_alone_s(model, num_reps: int = 3) -> float:
    """Seconds for one row through every weight matrix (x @ W.T), as one graph: the
    weight-reading part of a decode step without the rest of the model's graph."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    weights = [w for _, w in tree_flatten(model.parameters()) if w.ndim == 2]
    inputs = {w.shape[1]: mx.ones((1, w.shape[1])) for w in weights}
    mx.eval(list(inputs.values()))
    return best_of_s(lambda: mx.eval([inputs[w.shape[1]] @ w.T for w in weights]), num_reps, num_warmup=0)


def prepare(args, is_fused: bool, is_input_major: bool):
    """(model, prompt, facts about it): the model as gmlx loads it on CPU, with or without
    its compiled norm/rope and its input-major Linear weights."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from gmlx.platform.cpu_graph import fuse_cpu_ops
    from gmlx.platform.cpu_layout import store_weights_input_major
    from gmlx.platform.blas import describe_blas

    if args.random_params:
        model, prompt, name = make_random_qwen3(parse_count(args.random_params))
    else:
        model, prompt, name = load_folder(args.model)
    mx.eval(model.parameters())
    num_fused = fuse_cpu_ops(model) if is_fused else 0
    num_input_major = store_weights_input_major(model) if is_input_major else 0
    total_bytes, read_bytes = weight_bytes_per_token(model)
    return model, prompt, {"model": name, "num_params": sum(v.size for _, v in tree_flatten(model.parameters())),
                           "param_bytes": total_bytes, "read_bytes_per_token": read_bytes,
                           "blas": describe_blas(measure=False)["library"],
                           "num_fused_modules": num_fused, "num_input_major": num_input_major}


def measure(args, model, prompt) -> dict:
    """One run: decode speed and tokens, routed calls per token, the products alone."""
    from gmlx.platform.blas import routing_counts

    routed_before = routing_counts()[0]
    tokens, tokens_per_s = decode(model, prompt, args.warmup, args.tokens)
    routed_per_token = (routing_counts()[0] - routed_before) / (args.warmup + args.tokens)
    return {"tokens": tokens, "tokens_per_s": tokens_per_s, "routed_per_token": routed_per_token,
            "products_alone_s": products_alone_s(model)}


def child_decode(args) -> dict:
    from gmlx.platform.blas import ensure_fast_blas

    ensure_fast_blas()  # the BLAS (and, unless switched off, the interposer) before mlx

    from gmlx.config import is_cpu_fusion_enabled, is_input_major_enabled
    from gmlx.platform.blas import describe_blas

    model, prompt, info = prepare(args, is_cpu_fusion_enabled(), is_input_major_enabled())
    return {**info, "is_interposer_active": describe_blas(measure=False)["is_interposer_active"],
            **measure(args, model, prompt)}


class DramMeter:
    """This machine's DRAM read rate: the best of a numpy sum and an OpenBLAS sgemv over
    the same 1 GiB, each the best of num_reps passes."""

    def __init__(self):
        import ctypes

        import numpy as np

        from gmlx.platform.blas import describe_blas

        side = 1 << 14  # a 16384 x 16384 float32 matrix: 1 GiB
        self.a = np.ones(side * side, dtype=np.float32)
        self.sgemv = None
        library = describe_blas(measure=False)["library"]
        if library:
            fn = ctypes.CDLL(library).cblas_sgemv
            fn.argtypes = [ctypes.c_int] * 4 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                                ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
            x, y = np.ones(side, dtype=np.float32), np.zeros(side, dtype=np.float32)
            self.sgemv = lambda: fn(101, 111, side, side, 1.0, self.a.ctypes.data, side, x.ctypes.data, 1, 0.0,
                                    y.ctypes.data, 1)

    def measure(self, num_reps: int = 5) -> dict:
        out = {"numpy_sum_gbs": self.a.nbytes / best_of_s(self.a.sum, num_reps) / 1e9, "sgemv_gbs": None}
        if self.sgemv:
            out["sgemv_gbs"] = self.a.nbytes / best_of_s(self.sgemv, num_reps) / 1e9
        out["dram_gbs"] = max(v for v in out.values() if v)
        return out


def child_dram() -> dict:
    from gmlx.platform.blas import ensure_fast_blas

    ensure_fast_blas()  # the BLAS (and, unless switched off, the interposer) before mlx

    return DramMeter().measure()


def in_process(args, variants: dict) -> tuple[dict, list]:
    """Every variant's model in this one process, decoded in turn (ABBA order) each round,
    the DRAM rate measured after each round: the ratios see the same minutes of this
    shared box. "off" here is the interposer loaded with its routing switched off, so
    every call reaches OpenBLAS's own sgemm."""
    from gmlx.platform.blas import ensure_fast_blas

    ensure_fast_blas()  # the BLAS (and, unless switched off, the interposer) before mlx

    from gmlx.platform.blas import set_routing

    models, info = {}, {}
    for mode, (is_routed, is_fused, is_input_major) in variants.items():
        model, prompt, info[mode] = prepare(args, is_fused, is_input_major)
        info[mode]["is_interposer_active"] = is_routed
        models[mode] = (model, prompt)
    meter, drams = DramMeter(), []

    def run(mode: str) -> dict:
        model, prompt = models[mode]
        set_routing(variants[mode][0])
        try:
            return {**info[mode], **measure(args, model, prompt)}
        finally:
            set_routing(True)

    runs = alternate(variants, args.reps, run, lambda _: drams.append(meter.measure(num_reps=3)))
    return runs, drams


def decode(model, prompt, num_warmup: int, num_tokens: int) -> tuple[list[int], float]:
    """Greedy width-1 decode as mlx_lm's generate_step pipelines it (the next step's graph
    is built while this one runs); (tokens, timed tokens per second)."""
    from mlx_lm.generate import generate_step

    tokens, stamps = [], []
    for token, _ in generate_step(prompt, model, max_tokens=num_warmup + num_tokens):
        tokens.append(int(token))
        stamps.append(time.perf_counter())
    return tokens, (len(stamps) - 1 - num_warmup) / (stamps[-1] - stamps[num_warmup])


def run_child(argv: list[str], **env) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"child {argv} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="mlx-lm model folder (default: built-in)")
    parser.add_argument("--random-params", help="random float32 qwen3 of this size instead, e.g. 120M")
    parser.add_argument("--tokens", type=int, default=48, help="decode steps timed per run")
    parser.add_argument("--warmup", type=int, default=8, help="decode steps before timing")
    parser.add_argument("--reps", type=int, default=3, help="runs per mode, alternating on/off")
    parser.add_argument("--fusion-ab", action="store_true",
                        help="also run with the interposer on and GMLX_FUSE_CPU_OPS=0 in every rep")
    parser.add_argument("--layout-ab", action="store_true",
                        help="also run with the interposer on and GMLX_INPUT_MAJOR_WEIGHTS=0 in every rep")
    parser.add_argument("--in-process", action="store_true",
                        help="every mode's model in one process, decoded in turn each rep (tighter ratios)")
    parser.add_argument("--child", choices=["decode", "dram"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child_decode(args) if args.child == "decode" else child_dram()))
        return

    if args.in_process:  # mode -> (routing on, fused norm/rope, input-major weights)
        variants = {"on": (True, True, True), "off": (False, True, False)}
        if args.fusion_ab:
            variants["on, unfused"] = (True, False, True)
        if args.layout_ab:
            variants["on, row-major"] = (True, True, False)
        report(args, *in_process(args, variants))
        return
    child_argv = ["--child", "decode", "--model", args.model, "--tokens", str(args.tokens),
                  "--warmup", str(args.warmup)] + (["--random-params", args.random_params] if args.random_params else [])
    env_by_mode = {"on": {"GMLX_SGEMV_INTERPOSER": "1"}, "off": {"GMLX_SGEMV_INTERPOSER": "0"}}
    if args.fusion_ab:
        env_by_mode["on, unfused"] = {"GMLX_SGEMV_INTERPOSER": "1", "GMLX_FUSE_CPU_OPS": "0"}
    if args.layout_ab:
        env_by_mode["on, row-major"] = {"GMLX_SGEMV_INTERPOSER": "1", "GMLX_INPUT_MAJOR_WEIGHTS": "0"}
    drams = []  # the DRAM rate here moves by 1.5x within minutes: measured beside every round
    runs = alternate(env_by_mode, args.reps, lambda mode: run_child(child_argv, **env_by_mode[mode]),
                     lambda _: drams.append(run_child(["--child", "dram"])))
    report(args, runs, drams)


def report(args, runs: dict, drams: list[dict]) -> None:
    first = runs["on"][0]
    assert first["is_interposer_active"] and not runs["off"][0]["is_interposer_active"]
    median = {m: statistics.median(r["tokens_per_s"] for r in runs[m]) for m in runs}
    weight_gbs = {m: first["read_bytes_per_token"] * median[m] / 1e9 for m in runs}
    # Per-rep figures, each from runs made minutes apart at most, then their medians.
    speedup = median_ratio_of(runs["on"], runs["off"], "tokens_per_s")
    fraction = {m: statistics.median(first["read_bytes_per_token"] * r["tokens_per_s"] / 1e9 / d["dram_gbs"]
                                     for r, d in zip(runs[m], drams)) for m in runs}
    dram = {key: statistics.median(d[key] for d in drams if d[key]) if any(d[key] for d in drams) else None
            for key in drams[0]}
    is_same = all(r["tokens"] == first["tokens"] for m in runs for r in runs[m])
    print(f"model: {first['model']} ({first['num_params'] / 1e6:.1f}M params, {first['param_bytes'] / 1e6:.0f} MB; "
          f"{first['read_bytes_per_token'] / 1e6:.0f} MB read per token); BLAS: {first['blas']}")
    print(f"fused CPU norm/rope modules (GMLX_FUSE_CPU_OPS): {first['num_fused_modules']}; "
          f"Linear weights stored input-major (GMLX_INPUT_MAJOR_WEIGHTS): {first['num_input_major']}")
    print(f"decode width 1, mlx_lm generate_step, {args.tokens} tokens after {args.warmup} warm-up, "
          f"median of {args.reps} runs per mode, alternating\n")
    print("| interposer | tokens/s | ms/token | weight read GB/s | of DRAM read rate |")
    print("|---|---|---|---|---|")
    for m in runs:
        print(f"| {m} | {median[m]:.2f} | {1e3 / median[m]:.1f} | {weight_gbs[m]:.1f} | {fraction[m]:.2f} |")
    sgemv = f"{dram['sgemv_gbs']:.1f}" if dram["sgemv_gbs"] else "n/a"
    products_ms = {m: 1e3 * statistics.median(r["products_alone_s"] for r in runs[m]) for m in runs}
    print(f"\nthe weight products alone (one row through every matrix, one graph): on {products_ms['on']:.1f} ms, "
          f"off {products_ms['off']:.1f} ms; the rest of a decode step is the model's other graph nodes")
    print("(medians over reps; the DRAM fraction pairs each run with the DRAM rate measured "
          "right after it; the speedup is the median of per-rep on/off ratios)")
    if "on, unfused" in runs:
        fusion = median_ratio_of(runs["on"], runs["on, unfused"], "tokens_per_s")
        print(f"fused/unfused CPU norm/rope (interposer on): {fusion:.2f}x "
              f"({runs['on, unfused'][0]['num_fused_modules']} modules fused in the unfused runs)")
    if "on, row-major" in runs:
        layout = median_ratio_of(runs["on"], runs["on, row-major"], "tokens_per_s")
        print(f"input-major/row-major Linear weights (interposer on): {layout:.2f}x "
              f"({runs['on, row-major'][0]['num_input_major']} weights moved in the row-major runs)")
    print(f"speedup on/off: {speedup:.2f}x; greedy tokens identical across all runs: "
          f"{'yes' if is_same else 'NO'}; one-row calls routed per token: {first['routed_per_token']:.0f}")
    by_rep = ", ".join(f"{d['dram_gbs']:.1f}" for d in drams)
    print(f"DRAM read rate: {dram['dram_gbs']:.1f} GB/s median, per rep {by_rep} (best of a numpy sum of 1 GiB, median "
          f"{dram['numpy_sum_gbs']:.1f}, and an OpenBLAS sgemv over 1 GiB, median {sgemv})")
    print(json.dumps({
        "model": first["model"], "num_params": first["num_params"], "read_bytes_per_token": first["read_bytes_per_token"],
        "tokens_per_s": {m: [round(r["tokens_per_s"], 3) for r in runs[m]] for m in runs},
        "median_tokens_per_s": median, "speedup": speedup, "weight_read_gbs": weight_gbs,
        "dram": dram, "dram_gbs_by_rep": [d["dram_gbs"] for d in drams], "fraction_of_dram": fraction,
        "tokens_identical": is_same, "routed_per_token": first["routed_per_token"],
        "products_alone_ms": products_ms}))


if __name__ == "__main__":
    main()
