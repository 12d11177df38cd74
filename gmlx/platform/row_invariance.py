"""Row invariance off the CPU: a row's bits must not depend on what else rides in its forward.

Speculation is lossless only if a verify of k+1 positions, a batch of B rows and a plain step
give a row the same bits. On the CPU gmlx's kernels and the interposer fix each row's summation
order. On a GPU mlx's kernels are chosen by shape. Measured on an H200 with mlx 0.32.4 (CUDA,
scripts/row_bits_probe.py): a product's row changed with the row count (one row against two or more,
and cuBLAS picks other algorithms at other counts), and attention's with the query count, masked
keys before the row's and whether a mask was passed at all; 3 of the 25 speculative identity
tests failed. Two rules gave the same bits everywhere there (all 25 passed, the rules applied by a
test plugin; this module applies them at load):
- every product runs on exactly `block_rows` rows: the input is cut into blocks, the last
  padded with zero rows (a row's bits then depended on neither its place nor the other rows);
- attention runs one query a call, always with an array mask, over keys that start at
  position 0 (RaggedKVCache's layout): the bits then matched across batch rows and masked tails.
Metal is unmeasured; the rules assume nothing CUDA-specific, so they apply to every GPU.
Their cost there is extra calls: the model's body pads a forward's tokens to whole blocks once
(models/packed.py), and a masked one-query call costs ~25x an unmasked one on the H200, so
GMLX_ROW_ATTENTION=unmasked runs each row's query alone over exactly the keys it sees (the call a
lone row's plain step makes), pending its identity tests on a GPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from gmlx.config import product_block_rows, row_attention_rule, row_invariance_mode

logger = logging.getLogger(__name__)

_ATTENTION_RULES = {"masked": "attention one query a call with an array mask",
                    "unmasked": "attention one row and one query a call, unmasked, over the keys it sees"}


@dataclass(frozen=True, slots=True)
class RowRules:
    """The rules a model loads under, read once from the settings."""

    block_rows: int  # every product runs on blocks of exactly this many rows
    attention: str  # "masked" or "unmasked" (config.row_attention_rule)


def wanted_row_rules() -> RowRules | None:
    """The rules for this device and settings; None when off."""
    mode = row_invariance_mode()
    if mode == "0" or (mode == "auto" and mx.default_device() == mx.cpu):
        return None
    return RowRules(product_block_rows(), row_attention_rule())


def describe_row_invariance() -> str:
    rules = wanted_row_rules()
    if rules:
        return (f"on (GMLX_ROW_INVARIANCE={row_invariance_mode()}): products on blocks of {rules.block_rows} rows, "
                f"{_ATTENTION_RULES[rules.attention]}, so speculative and batched rows round as plain decoding")
    if mx.default_device() == mx.cpu:
        return "off on the CPU, where gmlx's kernels and sgemm interposer fix each row's summation order"
    return "off (GMLX_ROW_INVARIANCE=0): speculative output may differ from plain decoding at near-ties"


def in_fixed_blocks(product, x: mx.array, block_rows: int) -> mx.array:
    """product(x) for x (..., K), computed on blocks of exactly block_rows rows each."""
    leading, num_inputs = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, num_inputs)
    num_rows = rows.shape[0]
    assert num_rows > 0, x.shape
    if num_rows == block_rows:  # a block-padded body's forward (models/packed.py): no ops of our own
        return product(rows).reshape(*leading, -1)
    outputs = []
    for start in range(0, num_rows, block_rows):
        block = rows[start:start + block_rows]
        num_real = block.shape[0]
        if num_real < block_rows:
            block = mx.concatenate([block, mx.zeros((block_rows - num_real, num_inputs), dtype=block.dtype)])
        outputs.append(product(block)[:num_real])
    y = outputs[0] if len(outputs) == 1 else mx.concatenate(outputs)
    return y.reshape(*leading, y.shape[-1])


class _BlockRowsProduct:
    """Mixed into nn.Linear / nn.QuantizedLinear: the product on fixed row blocks."""

    block_rows: int

    def __call__(self, x: mx.array) -> mx.array:
        return in_fixed_blocks(super().__call__, x, self.block_rows)


class _BlockRowsTable:
    """Mixed into nn.Embedding / nn.QuantizedEmbedding: a tied head's product on fixed row blocks."""

    block_rows: int

    def as_linear(self, x: mx.array) -> mx.array:
        return in_fixed_blocks(super().as_linear, x, self.block_rows)


_MIXINS = {nn.Linear: _BlockRowsProduct, nn.QuantizedLinear: _BlockRowsProduct,
           nn.Embedding: _BlockRowsTable, nn.QuantizedEmbedding: _BlockRowsTable}
_SWAPPED: dict[type, type] = {}


def use_block_row_products(model: nn.Module, source: str, block_rows: int) -> int:
    """Every plain mlx product module of the model runs on fixed row blocks; the number swapped.
    Exact types only: gmlx's own CPU kernel modules keep their fixed orders."""
    num_swapped = 0
    for _, module in model.named_modules():
        cls = type(module)
        if cls not in _MIXINS:
            continue
        if cls not in _SWAPPED:
            _SWAPPED[cls] = type(f"BlockRows{cls.__name__}", (_MIXINS[cls], cls), {})
        module.__class__ = _SWAPPED[cls]
        module.block_rows = block_rows
        num_swapped += 1
    logger.info("model %s: %d products run on blocks of %d rows (row invariance)", source, num_swapped, block_rows)
    return num_swapped


def attend_one_query_a_call(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                            mask: mx.array) -> mx.array:
    """mx.fast.scaled_dot_product_attention for (B, H, T, D) queries, as T one-query calls;
    mask: (B, 1, T, S) bool, as RaggedKVCache.make_mask(T, return_array=True) builds it."""
    num_new = queries.shape[-2]
    assert isinstance(mask, mx.array) and mask.shape[-2] == num_new, mask
    if num_new == 1:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    outputs = [mx.fast.scaled_dot_product_attention(queries[..., i:i + 1, :], keys, values, scale=scale,
                                                    mask=mask[..., i:i + 1, :]) for i in range(num_new)]
    return mx.concatenate(outputs, axis=-2)


def attend_each_query_alone(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                            lengths: list[int]) -> mx.array:
    """mx.fast.scaled_dot_product_attention for (B, H, T, D) queries, as B x T unmasked one-query
    calls, each over exactly the keys its query sees: the call a lone row's plain step makes, so
    a row's bits cannot depend on its batch or verify depth. lengths: each row's keys before this
    forward's T (RaggedKVCache.lengths before the write); keys and values include the T."""
    num_new = queries.shape[-2]
    rows = []
    for row, length in enumerate(lengths):
        calls = [mx.fast.scaled_dot_product_attention(
            queries[row:row + 1, :, i:i + 1], keys[row:row + 1, :, :length + i + 1],
            values[row:row + 1, :, :length + i + 1], scale=scale) for i in range(num_new)]
        rows.append(calls[0] if num_new == 1 else mx.concatenate(calls, axis=2))
    return rows[0] if len(rows) == 1 else mx.concatenate(rows, axis=0)
