"""What the row-invariance rules (gmlx/platform/row_invariance.py) cost on this device, by part.

Prints a built-in model decode forward's time with the rules off and on at several block sizes
under each attention rule,
one product's time at 1 row and at each block size, one-query attention's time with and without
an array mask, and whether a product row's bits survive moving it among new rows in blocks of
each size (what a smaller block needs before it could be the default). Run on a GPU through
`bash scripts/cuda_bench.sh probe scripts/row_rules_cost.py`; the CPU's figures mean little,
as gmlx's CPU kernels replace mlx's products there.
"""

import time

import mlx.core as mx
import numpy as np

from gmlx.cache.ragged import make_ragged_cache
from gmlx.config import ROW_ATTENTION_RULES, env_overrides
from gmlx.models.loader import load_model
from row_bits_probe import num_moved_differing  # scripts/, beside this one

BLOCK_SIZES = (8, 16, 32)
PRODUCT_SHAPES = [(256, 256), (768, 256), (256, 768), (2048, 256), (576, 576), (1536, 576), (49152, 576)]
NUM_CALLS = 200


def batch_us(make_outputs) -> float:
    """Microseconds a call when NUM_CALLS independent calls are evaluated together."""
    mx.eval(make_outputs(4))
    start = time.perf_counter()
    mx.eval(make_outputs(NUM_CALLS))
    return (time.perf_counter() - start) / NUM_CALLS * 1e6


def forward_ms(target, num_rows: int, num_new: int, num_steps: int = 30) -> float:
    """Milliseconds a step of a decode loop (num_new tokens a row, read back each step)."""
    caches = make_ragged_cache(target.num_layers, num_rows, stored_dtype=target.kv_dtype)
    mx.eval(target.forward(mx.array([[5, 6, 7, 8, 9, 10] * 8] * num_rows), caches)[1])
    tokens = mx.array([[3] * num_new] * num_rows)
    times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        mx.eval(target.forward(tokens, caches)[1])
        times.append(time.perf_counter() - start)
        for cache in caches:
            cache.trim_rows([num_new - 1] * num_rows)
    return float(np.median(times) * 1e3)


def forwards() -> None:
    targets = {"off": {"GMLX_ROW_INVARIANCE": "0"}}
    for block_rows in BLOCK_SIZES:
        for rule in ROW_ATTENTION_RULES:
            targets[f"on, {block_rows} rows, {rule}"] = {"GMLX_ROW_INVARIANCE": "1", "GMLX_ROW_ATTENTION": rule,
                                                         "GMLX_PRODUCT_BLOCK_ROWS": str(block_rows)}
    for label, env in targets.items():
        with env_overrides(env):
            target = load_model(None)
        cells = [f"{b}x{t}: {forward_ms(target, b, t):.2f} ms" for b, t in ((1, 1), (8, 1), (4, 4), (32, 1))]
        print(f"forward, rules {label}: " + ", ".join(cells))


def products() -> None:
    for num_outputs, num_inputs in PRODUCT_SHAPES:
        weight = mx.random.normal((num_outputs, num_inputs)) * 0.05
        cells = []
        for num_rows in (1, *BLOCK_SIZES):
            xs = [mx.random.normal((num_rows, num_inputs), key=mx.random.key(i)) for i in range(8)]
            mx.eval(weight, xs)
            cells.append(f"{num_rows}: {batch_us(lambda n: [xs[i % 8] @ weight.T for i in range(n)]):.1f} us")
        moved = [f"{b} rows {num_moved_differing(weight, mx.random.normal((b, num_inputs)), (1, b // 2, b - 1))}/3"
                 for b in BLOCK_SIZES]
        print(f"product {num_outputs}x{num_inputs} float32: " + ", ".join(cells) + "; moved among new rows, differ: "
              + ", ".join(moved))


def attention() -> None:
    num_keys = 200
    queries = mx.random.normal((1, 9, 1, 64))
    keys, values = mx.random.normal((1, 3, num_keys, 64)), mx.random.normal((1, 3, num_keys, 64))
    mask = mx.ones((1, 1, 1, num_keys), dtype=mx.bool_)
    mx.eval(queries, keys, values, mask)

    def attend(n, mask=None):
        return [mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.125, mask=mask)
                for _ in range(n)]

    print(f"attention, one query, {num_keys} keys: no mask {batch_us(attend):.1f} us, "
          f"array mask {batch_us(lambda n: attend(n, mask)):.1f} us")


if __name__ == "__main__":
    print(mx.__version__, mx.default_device())
    forwards()
    products()
    attention()
