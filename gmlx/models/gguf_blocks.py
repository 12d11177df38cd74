"""GGUF quantized matrices as MLX affine triplets (weight, scales, biases; group 32), read from
their blocks' bytes where a block is an affine grid per 32 values, requantized where not.

Read from the bytes:
- Q4_0, Q4_1, Q8_0: exactly the triplets mx.load makes (4, 4 and 8 bits);
- Q5_0, Q5_1: exactly, their 5-bit levels at 8 bits (half float16's bytes; the kernels run 4 or 8);
- Q4_K, Q5_K: each 32-value sub-block is d * sc * q - dmin * m, so its levels stay as they are
  (4 bits, and Q5_K's at 8) under scale d * sc and bias -dmin * m rounded to float16, as every
  scale in the kernels' layouts is: each value within 2^-11 of |scale| x its top level + |bias|,
  at most 3x the sub-block's largest value;
- IQ4_NL, IQ4_XS: a 32-value block is a scale times 16 integer codebook values in [-127, 113],
  which are 8-bit levels less 128: exactly (IQ4_XS's scale d * (ls - 32) rounded to float16).
Requantized to 8 bits: the other types (Q6_K's 16-value sub-blocks share no 32-value grid, Q2_K,
Q3_K, the other IQ types), which the gguf package dequantizes.
The K-quants (Q2_K to Q6_K), K-quant files' bulk, are decoded in the CPU extension where it is available,
with these very steps (native_triplets); matrix_triplets picks the way for a matrix.
"""

import os
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np

GROUP_SIZE = 32  # every type read here, and every one mx.load keeps, is group 32
_SLICE_BYTES = 1 << 19  # a matrix's rows are decoded this many bytes of them at a time
_NATIVE_KINDS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")  # K-quant files' bulk, which the CPU extension decodes

# Per type read from its bytes: (bits of the MLX triplets, block bytes, values per block).
_READ_BLOCKS = {"Q4_0": (4, 18, 32), "Q4_1": (4, 20, 32), "Q8_0": (8, 34, 32), "Q5_0": (8, 22, 32),
                "Q5_1": (8, 24, 32), "Q4_K": (4, 144, 256), "Q5_K": (8, 176, 256), "IQ4_NL": (8, 18, 32),
                "IQ4_XS": (8, 136, 256)}
# The IQ4 types' 16 values a 4-bit index picks (llama.cpp's non-linear grid), times the block's scale.
_IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int16)


def is_read_from_blocks(kind: str) -> bool:
    return kind in _READ_BLOCKS


def matrix_triplets(name: str, kind: str, data: np.ndarray, dequantize, location: tuple | None = None) -> dict:
    """A quantized matrix's blocks (bytes, rows x blocks per row) of type `kind` as its module's
    MLX triplets: in the CPU extension where it decodes the kind (native_triplets; lazily where
    `location`, (path, byte offset), says where the blocks lie in a file), else from the blocks'
    bytes where they are affine grids (block_triplets), else requantized from dequantize(rows)'s values."""
    triplets = native_triplets(name, kind, data, location)
    if triplets is not None:
        return triplets
    if is_read_from_blocks(kind):
        return block_triplets(name, kind, data)
    return requantized(name, data, dequantize)


def block_triplets(name: str, kind: str, blocks: np.ndarray) -> dict:
    """A matrix's blocks (bytes, rows x blocks per row) of a type is_read_from_blocks names, as
    its module's MLX triplets, in numpy."""
    bits, block_bytes, _ = _READ_BLOCKS[kind]

    def decode(part: np.ndarray) -> tuple:
        rows = part.shape[0]
        weight_bytes, scales, biases = _DECODERS[kind](part.reshape(rows, -1, block_bytes))  # (rows, blocks, ...)
        return _words(weight_bytes.reshape(rows, -1)), scales.reshape(rows, -1), biases.reshape(rows, -1)

    return _triplets(name, blocks, decode)


def requantized(name: str, data: np.ndarray, dequantize=np.asarray) -> dict:
    """A matrix no block reading covers (data: its rows, as dequantize(rows) turns into float
    values) as MLX 8-bit affine triplets, group 32, at half float16's bytes, each value within
    half a level (1/510 of its group's range) and float16's rounding of the scale. The compute
    format then picks its kernels as for Q8_0."""

    def decode(part: np.ndarray) -> tuple:
        values = np.asarray(dequantize(part), dtype=np.float32)
        rows, columns = values.shape
        groups = values.reshape(rows, columns // GROUP_SIZE, GROUP_SIZE)
        low, high = groups.min(axis=-1, keepdims=True), groups.max(axis=-1, keepdims=True)
        # Float16 bias and scale (the kernels' layouts keep them so) rounded outwards, so that the
        # 256 levels span the whole group: a level clipped at either end would cost up to 2^-11 of
        # the values' size, not of their range.
        biases = low.astype(np.float16)
        biases = np.where(biases.astype(np.float32) > low, np.nextafter(biases, np.float16(-np.inf)), biases)
        scales = ((high - biases.astype(np.float32)) / 255).astype(np.float16)
        is_short = scales.astype(np.float32) * 255 + biases.astype(np.float32) < high
        scales = np.where(is_short, np.nextafter(scales, np.float16(np.inf)), scales)
        # The levels are rounded against those very values, so that rounding costs no accuracy twice.
        step = np.where(scales == 0, np.float32(1), scales.astype(np.float32))
        levels = np.clip(np.round((groups - biases.astype(np.float32)) / step), 0, 255).astype(np.uint8)
        return _words(levels.reshape(rows, columns)), scales[..., 0], biases[..., 0]

    return _triplets(name, data, decode)


def native_triplets(name: str, kind: str, blocks: np.ndarray, location: tuple | None = None) -> dict | None:
    """A K-quant (Q2_K to Q6_K) matrix's blocks (bytes, rows x blocks per row) decoded in the CPU
    extension, as block_triplets (Q4_K, Q5_K) and requantized from the gguf package's values (the others) decode them in
    numpy: the same values, read where they lie (no copy), at ~0.3 ns a Q4_K value and ~1.2 a
    Q6_K one on a 2-core Zen 4 (numpy's: 1.2 and 6-7). With `location`, (path, byte offset) of
    the blocks in their file, as lazy graph nodes decoded when evaluated: a matrix the CPU kernels
    pack from its blocks (K-tiles) is then never decoded (an 8B Q4_K_M load: ~3 s). None for other
    kinds or where the extension is not available (numpy's, then)."""
    from gmlx.platform import cpu_kernels

    if kind not in _NATIVE_KINDS or not cpu_kernels.is_available():
        return None
    _check_rows(name, blocks)
    ext = cpu_kernels.extension()
    if location is not None:
        path, offset = location
        return _named(name, *ext.lazy_gguf_triplets(str(path), offset, blocks.shape[0], blocks.shape[1], kind))
    # The bytes where they lie (the file's mapping): no copy of them into mlx first.
    return _named(name, *ext.decode_gguf_blocks(np.ascontiguousarray(blocks), kind))


def _triplets(name: str, data: np.ndarray, decode) -> dict:
    """A matrix's module weight, scales and biases from its rows' data, decode(rows) giving the
    three for a slice of them. Slices of ~_SLICE_BYTES keep numpy's temporaries in cache: whole
    matrices at a time, a 1B model's Q6_K ones took 20 ns a value."""
    _check_rows(name, data)
    step = max(1, _SLICE_BYTES // data[:1].nbytes)
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # numpy lets go of the GIL inside its loops
        parts = list(pool.map(decode, (data[first : first + step] for first in range(0, data.shape[0], step))))
    weight, scales, biases = (np.concatenate(arrays) if len(parts) > 1 else arrays[0] for arrays in zip(*parts))
    return _named(name, mx.array(weight), mx.array(scales), mx.array(biases))


def _check_rows(name: str, data: np.ndarray) -> None:
    if data.size == 0:
        raise ValueError(f"tensor {name}: an empty matrix (shape {data.shape})")


def _named(name: str, weight: mx.array, scales: mx.array, biases: mx.array) -> dict:
    """The triplets under their module's parameter names."""
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    return {f"{base}.weight": weight, f"{base}.scales": scales, f"{base}.biases": biases}


def _words(weight_bytes: np.ndarray) -> np.ndarray:
    """MLX's uint32 weight words from their bytes (rows, columns): 8-bit levels one a byte, 4-bit
    ones as _packed_nibbles gives them (level k of a word at bit bits * k, little-endian)."""
    assert weight_bytes.dtype == np.uint8, weight_bytes.dtype
    return np.ascontiguousarray(weight_bytes).view("<u4")


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of each block."""
    return blocks[..., at : at + 2].copy().view(np.float16)[..., 0]


def _packed_nibbles(packed: np.ndarray) -> np.ndarray:
    """4-bit levels as GGUF halves them (byte j of n: level j in the low nibble, level n + j in the
    high one) in MLX's packing, byte j holding levels 2j and 2j + 1: no level array between (as
    uint32 levels a 1B model's matrices took 4 GB and 6 s)."""
    even, odd = packed[..., 0::2], packed[..., 1::2]
    return np.concatenate([(even & 0x0F) | (odd << 4), (even >> 4) | (odd & 0xF0)], axis=-1)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """32 levels from 16 bytes: byte j holds level j (low nibble) and level j + 16 (high)."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _fifth_bits(blocks: np.ndarray, at: int) -> np.ndarray:
    """Q5_0/Q5_1's high bits (a little-endian uint32 at byte `at`): bit j belongs to level j."""
    return np.unpackbits(blocks[..., at : at + 4], axis=-1, bitorder="little")


def _q4_0(blocks):  # d * (q - 8)
    d = _half(blocks, 0)
    return _packed_nibbles(blocks[..., 2:]), d, d * np.float16(-8)


def _q4_1(blocks):  # d * q + m
    return _packed_nibbles(blocks[..., 4:]), _half(blocks, 0), _half(blocks, 2)


def _q8_0(blocks):  # signed levels d * q: unsigned q + 128, bias -128 d
    d = _half(blocks, 0)
    return blocks[..., 2:] ^ np.uint8(0x80), d, d * np.float16(-128)  # int8 q's byte, flipped: q + 128


def _q5_0(blocks):  # d * (q - 16)
    d = _half(blocks, 0)
    return _nibbles(blocks[..., 6:]) | (_fifth_bits(blocks, 2) << 4), d, d * np.float16(-16)


def _q5_1(blocks):  # d * q + m
    return _nibbles(blocks[..., 8:]) | (_fifth_bits(blocks, 4) << 4), _half(blocks, 0), _half(blocks, 2)


def _k_scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A K-quant super-block's eight 6-bit sub-block scales and mins from its 12 bytes: the first
    four of each in the low 6 bits of bytes 0-3 and 4-7; the last four split between bytes
    8-11 (low 4 bits each) and the top 2 bits of bytes 0-3 (scales) and 4-7 (mins)."""
    low_scales, low_mins, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([low_scales & 63, (rest & 0x0F) | ((low_scales >> 6) << 4)], axis=-1)
    mins = np.concatenate([low_mins & 63, (rest >> 4) | ((low_mins >> 6) << 4)], axis=-1)
    return scales, mins


def _k_levels(packed: np.ndarray) -> np.ndarray:
    """A K-quant super-block's 256 4-bit levels as (8 sub-blocks, 32): each 32 bytes hold two
    sub-blocks, the first in the low nibbles."""
    chunks = packed.reshape(*packed.shape[:-1], 4, 1, 32)
    return np.concatenate([chunks & 0x0F, chunks >> 4], axis=-2).reshape(*packed.shape[:-1], 8, 32)


def _k_affine(blocks, weight_bytes):
    """Scale d * sc and bias -dmin * m per sub-block (exact in float32, then float16), beside the
    sub-blocks' weight bytes."""
    sub_scales, sub_mins = _k_scales_and_mins(blocks[..., 4:16])
    d, dmin = _half(blocks, 0).astype(np.float32), _half(blocks, 2).astype(np.float32)
    scales = (d[..., None] * sub_scales).astype(np.float16)
    biases = (-dmin[..., None] * sub_mins).astype(np.float16)
    return weight_bytes, scales, biases


def _q4_k(blocks):
    chunks = blocks[..., 16:144].reshape(*blocks.shape[:-1], 4, 32)  # two sub-blocks each, as _k_levels says
    return _k_affine(blocks, _packed_nibbles(chunks).reshape(*blocks.shape[:-1], 8, 16))


def _q5_k(blocks):
    # Byte i of the 32 high-bit bytes holds bit 4 of value i of each sub-block, sub-block s at bit s.
    high = (blocks[..., 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1  # (..., 32 values, 8 sub-blocks)
    return _k_affine(blocks, _k_levels(blocks[..., 48:176]) | (np.swapaxes(high, -1, -2) << 4))


def _iq4_levels(packed: np.ndarray) -> np.ndarray:
    """8-bit levels (codebook value + 128) of 32-value blocks packed as Q4_0's indices."""
    return (_IQ4_VALUES[_nibbles(packed)] + 128).astype(np.uint8)


def _iq4_nl(blocks):  # d * value
    d = _half(blocks, 0)
    return _iq4_levels(blocks[..., 2:]), d, d * np.float16(-128)


def _iq4_xs(blocks):
    # Sub-block b's 6-bit scale ls: 4 low bits in byte 4 + b // 2 (nibble b % 2), 2 high bits at
    # bit 2b of the uint16 at byte 2; its 32 indices in bytes 8 + 16b .. 8 + 16b + 15.
    low = np.concatenate([blocks[..., 4:8, None] & 0x0F, blocks[..., 4:8, None] >> 4], axis=-1).reshape(
        *blocks.shape[:-1], 8)
    high_bits = blocks[..., 2:4].copy().view("<u2")  # (..., 1)
    high = (high_bits >> (2 * np.arange(8, dtype=np.uint16))) & 3
    sub_scales = (low.astype(np.int16) | (high.astype(np.int16) << 4)) - 32
    scales = (_half(blocks, 0).astype(np.float32)[..., None] * sub_scales).astype(np.float16)
    levels = _iq4_levels(blocks[..., 8:].reshape(*blocks.shape[:-1], 8, 16))
    return levels, scales, scales * np.float16(-128)


# Each gives (weight bytes, scales, biases) per block: 4-bit types their levels as MLX packs them
# (_packed_nibbles), 8-bit ones a level a byte.
_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q4_K": _q4_k,
             "Q5_K": _q5_k, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs}
