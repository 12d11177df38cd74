"""The forward of a round that carries a prompt chunk, three ways, side by side in one process.

A plain or gated round beside an arriving prompt runs its decode rows and a chunk of the prompt
together (spec/speculative.py `_forward`). The three ways give every row the same bits
(tests/test_packed_prefill.py):
- packed: one unfused forward over both segments end to end (models/packed.py), mlx-lm's ~20
  nodes a layer;
- apart: each segment's own fused forward (one stack node each), in one graph;
- one node: both segments in one stack node, their products sharing one pass over the
  weights (platform/cpu_layers.py segment_bodies; the default where layers are fused).
Decode rows sit at --kv-tokens positions, the chunk's cache at --chunk-start; each timed
forward trims what it wrote. Best of --best per rep, reps in ABBA turns (scripts/ab.py),
ratios the median of per-rep ratios.

    PYTHONPATH=. python3 scripts/bench_chunk_rounds.py                  # SmolLM2, 1 and 8 rows
    PYTHONPATH=. python3 scripts/bench_chunk_rounds.py --rows 4 --chunks 32,128 --reps 9
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this tree's gmlx
sys.path.insert(0, str(ROOT / "scripts"))

import bench_decode_ops  # noqa: E402  (sets the BLAS up before mlx)

import mlx.core as mx  # noqa: E402

from ab import alternate, median_ratio  # noqa: E402
from gmlx.models.loader import load_model  # noqa: E402
from gmlx.models.packed import Segment, packed_body, unpack  # noqa: E402
from gmlx.models.source import resolve_model_path  # noqa: E402
from gmlx.platform.cpu_layers import segment_bodies  # noqa: E402
from gmlx.platform.timing import best_of_s  # noqa: E402

MODES = ("packed", "apart", "one node")


def _together(target, mode: str, segments: list[Segment]) -> list[mx.array]:
    if mode == "packed":
        return unpack(packed_body(target.body, segments), segments)
    if mode == "apart":
        return [target.body(s.tokens, s.caches) for s in segments]
    return segment_bodies(target.body, segments)


def round_fn(target, mode: str, num_rows: int, num_chunk_tokens: int, kv_tokens: int, chunk_start: int):
    """A timed forward of num_rows decode rows beside a chunk, which trims what it wrote."""
    decode = Segment(mx.array([[7]] * num_rows), bench_decode_ops.prefilled_cache(target, num_rows, kv_tokens))
    chunk_tokens = mx.array([[(13 * i) % 1000 + 3 for i in range(num_chunk_tokens)]])
    chunk = Segment(chunk_tokens, bench_decode_ops.prefilled_cache(target, 1, chunk_start))

    def run():
        hidden, chunk_hidden = _together(target, mode, [decode, chunk])
        mx.eval(target.head(hidden), chunk_hidden)
        for segment in (decode, chunk):
            for layer in segment.caches:
                layer.trim(segment.tokens.shape[1])

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="a folder, a .gguf, smollm2 or builtin")
    parser.add_argument("--rows", default="1,8", help="decode rows beside the chunk, a comma list")
    parser.add_argument("--chunks", default="16,64,256", help="chunk tokens, a comma list")
    parser.add_argument("--kv-tokens", type=int, default=160)
    parser.add_argument("--chunk-start", type=int, default=64, help="tokens the chunk's cache holds already")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--best", type=int, default=5, help="timed forwards per rep and mode (the best counts)")
    args = parser.parse_args()
    target = load_model(resolve_model_path(None if args.model == "builtin" else args.model))
    if not target.is_layer_fused:
        sys.exit("the target's layers are not fused here (kernels not built, or a switch is off)")
    print(f"# {platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{args.model}, decode rows at {args.kv_tokens} KV tokens, chunk from {args.chunk_start}; "
          f"best of {args.best}, median of {args.reps} ABBA reps")
    print("| rows + chunk tokens | " + " | ".join(f"{m} ms" for m in MODES) + " | one node / apart | one node / packed |")
    print("|---" * (len(MODES) + 3) + "|")
    for num_rows in (int(r) for r in args.rows.split(",")):
        for num_chunk_tokens in (int(c) for c in args.chunks.split(",")):
            fns = {m: round_fn(target, m, num_rows, num_chunk_tokens, args.kv_tokens, args.chunk_start) for m in MODES}
            runs = alternate(MODES, args.reps, lambda m: best_of_s(fns[m], args.best))
            medians = {m: sorted(runs[m])[len(runs[m]) // 2] * 1e3 for m in MODES}
            apart = median_ratio(zip(runs["one node"], runs["apart"]))
            packed = median_ratio(zip(runs["one node"], runs["packed"]))
            cells = " | ".join(f"{medians[m]:.2f}" for m in MODES)
            print(f"| {num_rows} + {num_chunk_tokens} | {cells} | {apart:.3f} | {packed:.3f} |", flush=True)


if __name__ == "__main__":
    main()
