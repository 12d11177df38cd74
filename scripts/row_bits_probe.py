"""Does a row's result depend on what else is in the call, on this device?

For mlx's products and attention, prints which row counts give a row the same bits, whether a
row's bits survive moving it in a fixed-size block among other rows, and for attention whether a
query's bits change with the query count, masked keys before or after its own, an all-true mask,
batch rows and its slot in a fixed 16-query block (if that holds, attention could take fixed query
blocks as products take fixed row blocks, instead of one query a call). These are the facts
gmlx/platform/row_invariance.py's rules rest on. Run on a GPU through `bash scripts/cuda_bench.sh
probe scripts/row_bits_probe.py [--attention-only]`; on the CPU every answer is "same"
(BENCHMARKS.md has the H200's).
"""

import sys

import mlx.core as mx
import numpy as np

BLOCK_ROWS = 32
ROW_COUNTS = [*range(1, 10), 16, 17, 31, 32, 33, 64, 128, 160]
SHAPES = [(576, 576), (1536, 576), (49152, 576), (4096, 4096)]  # SmolLM2's products and a 7B's
HEADS, KV_HEADS, HEAD_DIM, NUM_KEYS = 9, 3, 64, 100
QUERY_BLOCK = 16


def as_np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


def classes(results: dict) -> str:
    """Row counts grouped by identical bits, e.g. '1 | 2-6,31-33 | 7-17'."""
    groups: list[tuple[list, np.ndarray]] = []
    for key, value in results.items():
        for members, bits in groups:
            if np.array_equal(bits, value):
                members.append(key)
                break
        else:
            groups.append(([key], value))
    return " | ".join(",".join(map(str, members)) for members, _ in groups)


def num_moved_differing(weight: mx.array, block: mx.array, places) -> int:
    """Of these places in a block-sized call, at how many block's row 0 gets other bits than in
    the block itself when it sits there among new rows."""
    want = as_np(block @ weight.T)[0]
    num_differing = 0
    for place in places:
        others = mx.random.normal(block.shape).astype(block.dtype)
        shuffled = mx.concatenate([others[:place], block[:1], others[place + 1:]])
        num_differing += not np.array_equal(as_np(shuffled @ weight.T)[place], want)
    return num_differing


def products() -> None:
    for dtype in (mx.float32, mx.bfloat16):
        for num_outputs, num_inputs in SHAPES:
            weight = (mx.random.normal((num_outputs, num_inputs)) * 0.05).astype(dtype)
            x = mx.random.normal((max(ROW_COUNTS), num_inputs)).astype(dtype)
            row0 = {m: as_np(x[:m] @ weight.T)[0] for m in ROW_COUNTS}
            moved = num_moved_differing(weight, x[:BLOCK_ROWS], (1, 5, 17, BLOCK_ROWS - 1))
            print(f"product {dtype} {num_outputs}x{num_inputs}: row 0's bits by row count: {classes(row0)}; "
                  f"in a {BLOCK_ROWS}-row block, moved among new rows: {moved}/4 differ")
    weight = mx.random.normal((1536, 576)) * 0.05
    packed, scales, biases = mx.quantize(weight, group_size=32, bits=4)
    x = mx.random.normal((max(ROW_COUNTS), 576))
    row0 = {m: as_np(mx.quantized_matmul(x[:m], packed, scales, biases, group_size=32, bits=4))[0] for m in ROW_COUNTS}
    print(f"quantized product 4-bit 1536x576: row 0's bits by row count: {classes(row0)}")


def attention() -> None:
    scale = HEAD_DIM ** -0.5
    for dtype in (mx.float32, mx.bfloat16):
        keys = mx.random.normal((1, KV_HEADS, NUM_KEYS + 64, HEAD_DIM)).astype(dtype)
        values = mx.random.normal((1, KV_HEADS, NUM_KEYS + 64, HEAD_DIM)).astype(dtype)
        queries = mx.random.normal((1, HEADS, NUM_KEYS, HEAD_DIM)).astype(dtype)

        def attend(q, k, v, mask):
            return as_np(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask))

        for is_masked in (False, True):
            def alone(p):  # the query at position p over keys 0..p, as a plain decode step sees it
                mask = mx.ones((1, p + 1), dtype=mx.bool_) if is_masked else None
                return attend(queries[:, :, p:p + 1], keys[:, :, :p + 1], values[:, :, :p + 1], mask)[0, :, 0]

            last = NUM_KEYS - 1
            by_queries = []
            for num_new in (2, 3, 4, 8, 16):
                mask = mx.arange(NUM_KEYS)[None] <= mx.arange(NUM_KEYS - num_new, NUM_KEYS)[:, None]
                out = attend(queries[:, :, -num_new:], keys[:, :, :NUM_KEYS], values[:, :, :NUM_KEYS], mask)[0]
                by_queries.append(sum(not np.array_equal(out[:, i], alone(NUM_KEYS - num_new + i))
                                      for i in range(num_new)))
            tail = [int(not np.array_equal(
                attend(queries[:, :, last:last + 1], keys[:, :, :NUM_KEYS + pad], values[:, :, :NUM_KEYS + pad],
                       (mx.arange(NUM_KEYS + pad) <= last)[None])[0, :, 0], alone(last))) for pad in (1, 3, 16, 64)]
            head = []
            for pad in (1, 3, 16, 64):
                k, v = (mx.concatenate([mx.random.normal((1, KV_HEADS, pad, HEAD_DIM)).astype(dtype),
                                        a[:, :, :NUM_KEYS]], axis=2) for a in (keys, values))
                out = attend(queries[:, :, last:last + 1], k, v, (mx.arange(pad + NUM_KEYS) >= pad)[None])[0, :, 0]
                head.append(int(not np.array_equal(out, alone(last))))
            batch_q = mx.concatenate([queries[:, :, last:last + 1],
                                      mx.random.normal((2, HEADS, 1, HEAD_DIM)).astype(dtype)])
            batch_kv = [mx.concatenate([a[:, :, :NUM_KEYS]] * 3) for a in (keys, values)]
            batch_mask = mx.ones((3, 1, 1, NUM_KEYS), dtype=mx.bool_) if is_masked else None
            is_batch_same = np.array_equal(attend(batch_q, *batch_kv, batch_mask)[0, :, 0], alone(last))
            print(f"attention {dtype}, the alone call {'masked' if is_masked else 'unmasked'}: queries differing "
                  f"at 2,3,4,8,16 queries a call: {by_queries}; masked keys after it (1,3,16,64): {tail}; "
                  f"before it (1,3,16,64): {head}; in a batch of 3: {'same' if is_batch_same else 'differs'}")
        # A cheaper rule than one query a call, if this holds: fixed blocks of queries, like products.
        block_keys, block_values = keys[:, :, :NUM_KEYS], values[:, :, :NUM_KEYS]
        target_q, target_pos = queries[:, :, last - 7:last - 6], last - 7
        slots = []
        for slot in (0, 3, QUERY_BLOCK - 1):
            others = mx.random.normal((1, HEADS, QUERY_BLOCK, HEAD_DIM)).astype(dtype)
            block_q = mx.concatenate([others[:, :, :slot], target_q, others[:, :, slot + 1:]], axis=2)
            positions = mx.array([target_pos if i == slot else 20 + 5 * i for i in range(QUERY_BLOCK)])
            mask = mx.arange(NUM_KEYS)[None] <= positions[:, None]
            slots.append(attend(block_q, block_keys, block_values, mask)[0, :, slot])
        is_slot_same = all(np.array_equal(slots[0], other) for other in slots[1:])
        print(f"attention {dtype}: in a masked {QUERY_BLOCK}-query call, a query moved among new queries: "
              f"{'same' if is_slot_same else 'differs'}")
        # GMLX_ROW_ATTENTION=unmasked's one assumption: the unmasked call over a query's own keys
        # keeps its bits whichever buffer the keys sit in (a batch cache's row, another capacity).
        alone_here = attend(queries[:, :, last:last + 1], keys[:, :, :NUM_KEYS], values[:, :, :NUM_KEYS], None)
        buffers = [mx.concatenate([mx.random.normal((1, KV_HEADS, 256, HEAD_DIM)).astype(dtype),
                                   mx.pad(a[:, :, :NUM_KEYS], [(0, 0), (0, 0), (0, 256 - NUM_KEYS), (0, 0)]),
                                   mx.random.normal((1, KV_HEADS, 256, HEAD_DIM)).astype(dtype)]) for a in (keys, values)]
        in_batch = attend(queries[:, :, last:last + 1], buffers[0][1:2, :, :NUM_KEYS], buffers[1][1:2, :, :NUM_KEYS],
                          None)
        contiguous = attend(queries[:, :, last:last + 1], *(mx.contiguous(a[:, :, :NUM_KEYS]) for a in (keys, values)),
                            None)
        print(f"attention {dtype}, unmasked over its own keys: as row 1 of a 3-row, 256-capacity buffer "
              f"{'same' if np.array_equal(in_batch, alone_here) else 'differs'}; from a contiguous copy "
              f"{'same' if np.array_equal(contiguous, alone_here) else 'differs'}")
        full = attend(queries[:, :, -1:], keys[:, :, :NUM_KEYS], values[:, :, :NUM_KEYS], None)[0, :, 0]
        all_true = attend(queries[:, :, -1:], keys[:, :, :NUM_KEYS], values[:, :, :NUM_KEYS],
                          mx.ones((1, NUM_KEYS), dtype=mx.bool_))[0, :, 0]
        is_same = np.array_equal(full, all_true)
        print(f"attention {dtype}: an all-true mask against none: {'same' if is_same else 'differs'}")


if __name__ == "__main__":
    mx.random.seed(0)
    print(mx.__version__, mx.default_device())
    if "--attention-only" not in sys.argv:  # the products' part alone took ~45 s on an H200
        products()
    attention()
