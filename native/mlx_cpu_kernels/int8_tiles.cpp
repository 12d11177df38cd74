// The int8 path over the tile layout (int8_dot_kernels.h): 16 outputs a tile, one lane each,
// so a row's block sum needs no reduction across lanes. Per output the float operations of
// the quad layout and the plain rows: p = d_j * float(isum), then on lane j % 4
// fma(s, p, lane) and fma(b, xsd_j, lane), and (lane0 + lane1) + (lane2 + lane3) at the end.
#include <algorithm>
#include <atomic>
#include <cassert>
#include <cmath>
#include <cstring>
#include <vector>

#include "int8_dot_kernels.h"
#include "int8_walk.h"
#include "isa_target.h"

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace gmlx_kernels {

namespace {

constexpr int kLanes = 4;  // float lanes per output: block j adds into lane j % 4
constexpr int64_t kVectorsPerBlock = 8;  // vpdpbusd steps a block: four x bytes each

// Software prefetch 8 blocks ahead: on an Intel VNNI core 1.03-1.10x width-1 decode and a 2-4
// position forward 1.05-1.10x (scripts/bench_kernel_settings.py); on Zen 4 it cost width-1 decode
// 0.91x, so other CPUs leave the stream to the hardware prefetcher.
constexpr int64_t kIntelPrefetchBlocks = 8;

constexpr int64_t kBlocksPerSuper = kSuperBlockInputs / kInt8BlockInputs;
constexpr int64_t kBlockWeightBytes4 = kTileOutputs * kInt8BlockInputs / 2;  // a 4-bit block's weight vectors

int64_t tile_bytes(int64_t num_inputs, int bits) {
  if (is_k_layout(bits)) return num_inputs / kSuperBlockInputs * k_super_bytes(bits);
  return num_inputs / kInt8BlockInputs * tile_block_bytes(bits);
}

// Block i's weight vectors in a K-tile (kK4Bits: a 4-bit tile block's first 256 bytes) or K5-tile
// super-block (those 256 bytes and 64 of fifth bits).
template <int kBits>
inline const uint8_t* k4_block(const uint8_t* super, int64_t i) {
  static_assert(kBits == kK4Bits || kBits == kK5Bits);
  return super + kK4HeaderBytes + i * (kBits == kK4Bits ? kBlockWeightBytes4 : kK5BlockBytes);
}

// Weight q of output o (0-15), input t (0-31) of a block's weights (at 5 bits, the 4-bit vectors'
// nibble and bit t / 4 of byte 4o + t % 4 of the fifth bits after them; IQ4 tiles, the nibble's level).
inline int tile_weight(const uint8_t* block, int o, int t, int bits) {
  if (bits == 8) return block[t / 4 * 64 + 4 * o + t % 4];
  const uint8_t byte = block[t / 8 * 64 + 4 * o + t % 4];
  const int low = t % 8 < 4 ? byte & 0xF : byte >> 4;
  if (bits == 4) return low;
  if (bits == kIq4Bits) return kIq4Levels[low];
  return low | (((block[kBlockWeightBytes4 + 4 * o + t % 4] >> (t / 4)) & 1) << 4);
}

// Weight q (0-15, or 0-31 in a K5-tile) of output o, input t of block i of a K-tile super-block.
template <int kBits>
inline int k4_weight(const uint8_t* super, int64_t i, int o, int t) {
  return tile_weight(k4_block<kBits>(super, i), o, t, kBits == kK4Bits ? 4 : kFiveBits);
}

// The layouts of 16-input sub-blocks under int8 scales (K6-tiles and K3-tiles): their levels' offset.
constexpr int k_sub_block_offset(int bits) { return bits == kK6Bits ? 32 : 4; }

// Block i's weight bytes in a K6-tile (kK6Bits) or K3-tile (kK3Bits) super-block.
template <int kBits>
inline const uint8_t* k6_block(const uint8_t* super, int64_t i) {
  static_assert(kBits == kK6Bits || kBits == kK3Bits);
  return super + kK6HeaderBytes + i * (kBits == kK6Bits ? kK6BlockBytes : kK3BlockBytes);
}

// Weight q (0-63) of output o, input t (0-31) of a K6-tile block.
inline int k6_weight(const uint8_t* block, int o, int t) {
  const int i = t / 4, high = (block[kBlockWeightBytes4 + 64 * (i / 4) + 4 * o + t % 4] >> (2 * (i % 4))) & 3;
  return tile_weight(block, o, t, 4) | (high << 4);
}

// Weight q (0-7) of output o, input t (0-31) of a K3-tile block: vector i = t / 4's low 2 bits at bits
// 2 (i % 4) of byte 64 (i / 4) + 4o + t % 4, its third at bit i of byte 128 + 4o + t % 4.
inline int k3_weight(const uint8_t* block, int o, int t) {
  const int i = t / 4, low = (block[64 * (i / 4) + 4 * o + t % 4] >> (2 * (i % 4))) & 3;
  return low | (((block[2 * 64 + 4 * o + t % 4] >> i) & 1) << 2);
}

// Weight q of output o, input t of block i of a K6-tile or K3-tile super-block.
template <int kBits>
inline int k6_super_weight(const uint8_t* super, int64_t i, int o, int t) {
  const uint8_t* block = k6_block<kBits>(super, i);
  return kBits == kK6Bits ? k6_weight(block, o, t) : k3_weight(block, o, t);
}

// Sub-block h (0-15) of a K6-tile (or K3-tile) super-block's output o: its scale d * sc, exact in float32.
inline float k6_scale(const uint8_t* super, int h, int o) {
  const auto* halves = reinterpret_cast<const uint16_t*>(super);
  const auto* sub_scales = reinterpret_cast<const int8_t*>(super + 2 * kTileOutputs);
  return half_to_float(halves[o]) * static_cast<float>(sub_scales[kTileOutputs * h + o]);
}

// Block i (0-7) of a K-tile super-block's output o: scale d * sc and bias -dmin * m, exact in float32.
struct ScaleBias {
  float scale, bias;
};

inline ScaleBias k4_scale_and_bias(const uint8_t* super, int i, int o) {
  const auto* halves = reinterpret_cast<const uint16_t*>(super);
  const uint8_t* sub_scales = super + 4 * kTileOutputs;
  const uint8_t* sub_mins = sub_scales + kTileOutputs * kBlocksPerSuper;
  return {half_to_float(halves[o]) * static_cast<float>(sub_scales[kTileOutputs * i + o]),
          -half_to_float(halves[kTileOutputs + o]) * static_cast<float>(sub_mins[kTileOutputs * i + o])};
}

// Block i's weight bytes in a K2-tile super-block, and weight q (0-3) of output o, input t (0-31) there:
// a K3-tile block's low 2 bits.
inline const uint8_t* k2_block(const uint8_t* super, int64_t i) { return super + kK2HeaderBytes + i * kK2BlockBytes; }
inline int k2_weight(const uint8_t* block, int o, int t) {
  return (block[64 * (t / 16) + 4 * o + t % 4] >> (t % 16 / 4 * 2)) & 3;
}

// Sub-block h (0-15) of a K2-tile super-block's output o: scale d * sc and bias -dmin * m, exact in float32.
inline ScaleBias k2_scale_and_bias(const uint8_t* super, int h, int o) {
  const auto* halves = reinterpret_cast<const uint16_t*>(super);
  const uint8_t packed = super[4 * kTileOutputs + kTileOutputs * h + o];
  return {half_to_float(halves[o]) * static_cast<float>(packed & 0x0F),
          -half_to_float(halves[kTileOutputs + o]) * static_cast<float>(packed >> 4)};
}

// ---------------------------------------------------------------- portable

// A row's integer dot of output o with block j's 32 (or, from `first`, `count`) inputs; q(o, t)
// reads weight t of the block.
template <typename Weight>
int32_t block_dot(const int8_t* xq, int64_t j, int o, int first, int count, Weight q) {
  int32_t isum = 0;
  for (int t = first; t < first + count; ++t) isum += q(o, t) * xq[j * kInt8BlockInputs + t];
  return isum;
}

// The portable walks' frame: every row of every tile, a tile's 16 outputs in four lanes each;
// add_block(r, tile, j, o, lane) adds block j's float steps for output o of row r into lane j % 4.
template <typename AddBlock>
void walk_tiles_portable(const QmmArgs& a, int64_t begin, int64_t end, AddBlock add_block) {
  const int64_t num_blocks = a.num_inputs / kInt8BlockInputs, stride = tile_bytes(a.num_inputs, a.bits);
  for (int64_t r = 0; r < a.num_rows; ++r) {
    for (int64_t n0 = begin; n0 < end; n0 += kTileOutputs) {
      const uint8_t* tile = a.quads + n0 / kTileOutputs * stride;
      float lanes[kTileOutputs][kLanes] = {};
      for (int64_t j = 0; j < num_blocks; ++j) {
        for (int o = 0; o < kTileOutputs; ++o) add_block(r, tile, j, o, lanes[o][j % kLanes]);
      }
      for (int o = 0; o < std::min<int64_t>(kTileOutputs, end - n0); ++o) {
        a.y[r * a.num_outputs + n0 + o] = (lanes[o][0] + lanes[o][1]) + (lanes[o][2] + lanes[o][3]);
      }
    }
  }
}

// The 4- and 8-bit tiles: p = d_j * float(isum), then fma(s, p, lane) and fma(b, xsd_j, lane).
void tiles_portable(const QmmArgs& a, const QuantizedRows& x, int64_t begin, int64_t end) {
  const int64_t block_bytes = tile_block_bytes(a.bits), weight_bytes = block_bytes - 4 * kTileOutputs;
  walk_tiles_portable(a, begin, end, [&](int64_t r, const uint8_t* tile, int64_t j, int o, float& lane) {
    const uint8_t* block = tile + j * block_bytes;
    const auto* halves = reinterpret_cast<const uint16_t*>(block + weight_bytes);
    const auto q = [&](int oo, int t) { return tile_weight(block, oo, t, a.bits); };
    const float p = x.d_row(r)[j] * static_cast<float>(block_dot(x.q_row(r), j, o, 0, kInt8BlockInputs, q));
    lane = std::fma(half_to_float(halves[o]), p, lane);
    lane = std::fma(half_to_float(halves[kTileOutputs + o]), x.xsd_row(r)[j], lane);
  });
}

// The K-tiles and K5-tiles: the 4-bit tiles' steps with scale d * sc and bias -dmin * m, exact in float32.
template <int kBits>
void k4_tiles_portable(const QmmArgs& a, const QuantizedRows& x, int64_t begin, int64_t end) {
  walk_tiles_portable(a, begin, end, [&](int64_t r, const uint8_t* tile, int64_t j, int o, float& lane) {
    const uint8_t* super = tile + j / kBlocksPerSuper * k_super_bytes(kBits);
    const int i = static_cast<int>(j % kBlocksPerSuper);
    const ScaleBias sb = k4_scale_and_bias(super, i, o);
    const auto q = [&](int oo, int t) { return k4_weight<kBits>(super, i, oo, t); };
    const float p = x.d_row(r)[j] * static_cast<float>(block_dot(x.q_row(r), j, o, 0, kInt8BlockInputs, q));
    lane = std::fma(sb.scale, p, lane);
    lane = std::fma(sb.bias, x.xsd_row(r)[j], lane);
  });
}

// The K6-tiles (K3-tiles): per block each sub-block's integer sum less 32 (4) times x's sum there (A, B),
// then t = fma(s_a, float(A), s_b * float(B)) with s = d * sc, and fma(d_j, t, lane).
template <int kBits>
void k6_tiles_portable(const QmmArgs& a, const QuantizedRows& x, int64_t begin, int64_t end) {
  walk_tiles_portable(a, begin, end, [&](int64_t r, const uint8_t* tile, int64_t j, int o, float& lane) {
    const uint8_t* super = tile + j / kBlocksPerSuper * k_super_bytes(kBits);
    const int i = static_cast<int>(j % kBlocksPerSuper);
    const auto q = [&](int oo, int t) { return k6_super_weight<kBits>(super, i, oo, t); };
    int32_t isums[2];
    for (int h = 0; h < 2; ++h) {
      const int32_t offset_sum = k_sub_block_offset(kBits) * x.half_sums_row(r)[2 * j + h];
      isums[h] = block_dot(x.q_row(r), j, o, 16 * h, 16, q) - offset_sum;
    }
    const float t = std::fma(k6_scale(super, 2 * i, o), static_cast<float>(isums[0]),
                             k6_scale(super, 2 * i + 1, o) * static_cast<float>(isums[1]));
    lane = std::fma(x.d_row(r)[j], t, lane);
  });
}

// The K2-tiles: per block each sub-block's integer sum (A, B), then t = fma(s_a, float(A), s_b * float(B))
// with s = d * sc, fma(d_j, t, lane), then fma(b_a, half_xsd_a, lane) and fma(b_b, half_xsd_b, lane)
// with b = -dmin * m.
void k2_tiles_portable(const QmmArgs& a, const QuantizedRows& x, int64_t begin, int64_t end) {
  walk_tiles_portable(a, begin, end, [&](int64_t r, const uint8_t* tile, int64_t j, int o, float& lane) {
    const uint8_t* super = tile + j / kBlocksPerSuper * kK2SuperBytes;
    const int i = static_cast<int>(j % kBlocksPerSuper);
    const auto q = [&](int oo, int t) { return k2_weight(k2_block(super, i), oo, t); };
    const ScaleBias sub_a = k2_scale_and_bias(super, 2 * i, o), sub_b = k2_scale_and_bias(super, 2 * i + 1, o);
    const float t = std::fma(sub_a.scale, static_cast<float>(block_dot(x.q_row(r), j, o, 0, 16, q)),
                             sub_b.scale * static_cast<float>(block_dot(x.q_row(r), j, o, 16, 16, q)));
    lane = std::fma(x.d_row(r)[j], t, lane);
    lane = std::fma(sub_a.bias, x.half_xsd_row(r)[2 * j], lane);
    lane = std::fma(sub_b.bias, x.half_xsd_row(r)[2 * j + 1], lane);
  });
}

#if GMLX_X86

// ---------------------------------------------------------------- AVX-512 VNNI

// acc + dpbusd(w, four bytes of x broadcast): the broadcast as the instruction's memory operand,
// one fused uop instead of a broadcast load and a dot (GCC does not fold it). Same bits.
GMLX_AVX512_VNNI inline __attribute__((always_inline)) __m512i dot_broadcast(__m512i acc, __m512i w,
                                                                           const int8_t* four) {
#if defined(__GNUC__)
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(four)));
  return acc;
#else
  int32_t bytes;
  std::memcpy(&bytes, four, sizeof(bytes));
  return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(bytes));
#endif
}

// Vector i of a block's weights (16 outputs x 4 inputs as bytes): at 4 bits the low then the
// high nibbles of each 64 bytes (IQ4 tiles: their levels), at 8 bits the 64 bytes as they are.
// It pairs with x's bytes 4i..4i+3.
template <int kBits>
GMLX_AVX512_VNNI inline __attribute__((always_inline)) void block_vectors(const uint8_t* block, int t,
                                                                        __m512i* pair) {
  const __m512i v = _mm512_loadu_si512(block + 64 * t);
  if constexpr (kBits == 4) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    pair[0] = _mm512_and_si512(v, nibble);
    pair[1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
  } else if constexpr (kBits == kIq4Bits) {  // each index looked up in every 128-bit lane's copy of the levels
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const __m512i levels = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Levels)));
    pair[0] = _mm512_shuffle_epi8(levels, _mm512_and_si512(v, nibble));
    pair[1] = _mm512_shuffle_epi8(levels, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
  } else {
    pair[0] = v;
  }
}

// A tile's outputs [n0, min(n0 + 16, end)) of rows [r0, r0 + kRows): each row's four lanes summed
// as (lane0 + lane1) + (lane2 + lane3).
template <int kRows>
GMLX_AVX512_VNNI inline __attribute__((always_inline)) void store_tile_rows(const QmmArgs& a, int64_t r0, int64_t n0,
                                                                          int64_t end, __m512 (*lanes)[kLanes]) {
  const __mmask16 valid = static_cast<__mmask16>((1u << std::min<int64_t>(kTileOutputs, end - n0)) - 1);
  for (int r = 0; r < kRows; ++r) {
    const __m512 y = _mm512_add_ps(_mm512_add_ps(lanes[r][0], lanes[r][1]), _mm512_add_ps(lanes[r][2], lanes[r][3]));
    _mm512_mask_storeu_ps(a.y + (r0 + r) * a.num_outputs + n0, valid, y);
  }
}

// Block j's float steps for kRows rows from their integer block sums, into lane kLane of each row:
// p = d_j * float(isum), then fma(s, p, lane) and fma(b, xsd_j, lane). The VNNI and AMX walks and
// the K-tile walk all run these, so their bits are one another's.
template <int kRows, int kLane>
GMLX_AVX512_VNNI inline __attribute__((always_inline)) void add_floats(__m512 s, __m512 b, int64_t j,
                                                                     const RowsOf<kRows>& x, const __m512i* isums,
                                                                     __m512 (*lanes)[kLanes]) {
  for (int r = 0; r < kRows; ++r) {
    const __m512 p = _mm512_mul_ps(_mm512_set1_ps(x.d[r][j]), _mm512_cvtepi32_ps(isums[r]));
    __m512& lane = lanes[r][kLane];
    lane = _mm512_fmadd_ps(s, p, lane);
    lane = _mm512_fmadd_ps(b, _mm512_set1_ps(x.xsd[r][j]), lane);
  }
}

// add_floats with a tile block's own float16 scales and biases.
template <int kBits, int kRows, int kLane>
GMLX_AVX512_VNNI inline __attribute__((always_inline)) void add_block_floats(const uint8_t* block, int64_t j,
                                                                           const RowsOf<kRows>& x,
                                                                           const __m512i* isums,
                                                                           __m512 (*lanes)[kLanes]) {
  const auto* halves = reinterpret_cast<const __m256i*>(block + tile_weight_bytes(kBits));
  const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(halves));
  const __m512 b = _mm512_cvtph_ps(_mm256_loadu_si256(halves + 1));
  add_floats<kRows, kLane>(s, b, j, x, isums, lanes);
}

// Block j of a tile for kRows rows into lane kLane of each row. Each weight vector is unpacked
// just before every row's dot with it, so at four rows the sixteen lanes stay in registers
// (holding the block's eight vectors for all rows spilled one to the stack).
template <int kBits, int kRows>
GMLX_AVX512_VNNI inline __attribute__((always_inline)) void block_isums(const uint8_t* block, int64_t j,
                                                                      const RowsOf<kRows>& x, __m512i* isums) {
  constexpr int kPerLoad = kBits == 4 || kBits == kIq4Bits ? 2 : 1;  // weight vectors one 64-byte load holds
  // Few rows leave vpdpbusd's latency exposed: split each row's sum over independent chains.
  constexpr int kChains = kRows >= 3 ? 1 : 4 / kRows;
  __m512i partial[kRows][kChains];
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < kChains; ++c) partial[r][c] = _mm512_setzero_si512();
  }
  for (int t = 0; t < kVectorsPerBlock / kPerLoad; ++t) {
    __m512i pair[kPerLoad];
    block_vectors<kBits>(block, t, pair);
    for (int r = 0; r < kRows; ++r) {
      const int8_t* xq = x.q[r] + j * kInt8BlockInputs;
      for (int h = 0; h < kPerLoad; ++h) {
        const int i = kPerLoad * t + h;
        partial[r][i % kChains] = dot_broadcast(partial[r][i % kChains], pair[h], xq + 4 * i);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    isums[r] = partial[r][0];  // integer adds: exact in any order
    for (int c = 1; c < kChains; ++c) isums[r] = _mm512_add_epi32(isums[r], partial[r][c]);
  }
}

// Each byte's bits kLow.. (one bit for a K5-tile or K3-tile, kLow and kLow + 1 for a K6-tile) moved to
// bits kTo.., the rest zero: one GFNI affine byte op (its matrix's byte 7 - b picks result bit b's source
// bits). An asm: no target attribute, so one templated walk serves CPUs with GFNI and without.
template <int kLow, int kNumBits, int kTo = 4>
GMLX_AVX512_VNNI inline __attribute__((always_inline)) __m512i move_bits_gfni(__m512i bytes) {
  uint64_t rows = 0;
  for (int b = 0; b < kNumBits; ++b) rows |= (1ull << (kLow + b)) << (8 * (7 - kTo - b));
  const __m512i matrix = _mm512_set1_epi64(static_cast<long long>(rows));
  __m512i moved;
  asm("vgf2p8affineqb $0, %2, %1, %0" : "=v"(moved) : "v"(bytes), "v"(matrix));
  return moved;
}

// Bits 0..kTo-1 of `low` with bit kBit of `tops` as bit kTo: a K5-tile vector's 5-bit levels (kTo 4:
// nibbles and fifth bits) or a K3-tile's 3-bit ones (kTo 2), merged by one ternary-logic op (c ? b : a
// bit by bit, c = the low bits' mask). The top bits move by GFNI, else by an epi16 shift (which moves
// no bit of the next byte into bit kTo) and an and.
template <int kBit, bool kGfni, int kTo = 4>
GMLX_AVX512_VNNI inline __attribute__((always_inline)) __m512i with_top_bit(__m512i low, __m512i tops) {
  const __m512i low_mask = _mm512_set1_epi8((1 << kTo) - 1);
  __m512i top;
  if constexpr (kGfni) {
    top = move_bits_gfni<kBit, 1, kTo>(tops);
  } else {
    top = tops;
    if constexpr (kBit < kTo) top = _mm512_slli_epi16(tops, kTo - kBit);
    if constexpr (kBit > kTo) top = _mm512_srli_epi16(tops, kBit - kTo);
    top = _mm512_and_si512(top, _mm512_set1_epi8(1 << kTo));
  }
  return _mm512_ternarylogic_epi32(top, low, low_mask, 0xD8);
}

// Weight vector i of block j against every row's x bytes 4i..4i+3, into chain i % kChains.
template <int kRows, int kChains>
GMLX_AVX512_VNNI inline __attribute__((always_inline)) void dot_rows(int i, __m512i w, int64_t j,
                                                                   const RowsOf<kRows>& x,
                                                                   __m512i (*partial)[kChains]) {
  for (int r = 0; r < kRows; ++r) {
    partial[r][i % kChains] = dot_broadcast(partial[r][i % kChains], w, x.q[r] + j * kInt8BlockInputs + 4 * i);
  }
}

// block_isums over a K5-tile block: each weight vector's nibbles with its fifth bits merged in.
template <int kRows, bool kGfni>
GMLX_AVX512_VNNI inline __attribute__((always_inline)) void k5_block_isums(const uint8_t* block, int64_t j,
                                                                         const RowsOf<kRows>& x, __m512i* isums) {
  constexpr int kChains = kRows >= 3 ? 1 : 4 / kRows;
  const __m512i fifths = _mm512_loadu_si512(block + kBlockWeightBytes4);
  __m512i partial[kRows][kChains];
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < kChains; ++c) partial[r][c] = _mm512_setzero_si512();
  }
  const __m512i v0 = _mm512_loadu_si512(block), v1 = _mm512_loadu_si512(block + 64);
  const __m512i v2 = _mm512_loadu_si512(block + 128), v3 = _mm512_loadu_si512(block + 192);
  dot_rows<kRows, kChains>(0, with_top_bit<0, kGfni>(v0, fifths), j, x, partial);
  dot_rows<kRows, kChains>(1, with_top_bit<1, kGfni>(_mm512_srli_epi16(v0, 4), fifths), j, x, partial);
  dot_rows<kRows, kChains>(2, with_top_bit<2, kGfni>(v1, fifths), j, x, partial);
  dot_rows<kRows, kChains>(3, with_top_bit<3, kGfni>(_mm512_srli_epi16(v1, 4), fifths), j, x, partial);
  dot_rows<kRows, kChains>(4, with_top_bit<4, kGfni>(v2, fifths), j, x, partial);
  dot_rows<kRows, kChains>(5, with_top_bit<5, kGfni>(_mm512_srli_epi16(v2, 4), fifths), j, x, partial);
  dot_rows<kRows, kChains>(6, with_top_bit<6, kGfni>(v3, fifths), j, x, partial);
  dot_rows<kRows, kChains>(7, with_top_bit<7, kGfni>(_mm512_srli_epi16(v3, 4), fifths), j, x, partial);
  for (int r = 0; r < kRows; ++r) {
    isums[r] = partial[r][0];  // integer adds: exact in any order
    for (int c = 1; c < kChains; ++c) isums[r] = _mm512_add_epi32(isums[r], partial[r][c]);
  }
}

template <int kBits, int kRows, int kLane, bool kGfni>
GMLX_AVX512_VNNI inline __attribute__((always_inline)) void tile_block_avx512(const uint8_t* block, int64_t j,
                                                                            const RowsOf<kRows>& x,
                                                                            __m512 (*lanes)[kLanes]) {
  __m512i isums[kRows];
  if constexpr (kBits == kFiveBits) {
    k5_block_isums<kRows, kGfni>(block, j, x, isums);  // a K5-tile block's weight bytes
  } else {
    block_isums<kBits, kRows>(block, j, x, isums);
  }
  add_block_floats<kBits, kRows, kLane>(block, j, x, isums, lanes);
}

// Sixteen bytes as floats.
GMLX_AVX512_VNNI inline __attribute__((always_inline)) __m512 widen(const uint8_t* bytes) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes))));
}

// A K2-tile block's sub-block kH (weight vectors 4kH..4kH+3, the 64 bytes of 2-bit levels at 64 kH)
// summed against kRows rows' x.
template <int kRows, int kH>
GMLX_AVX512_VNNI inline __attribute__((always_inline)) void k2_sub_block_isums(const uint8_t* block, int64_t j,
                                                                             const RowsOf<kRows>& x, __m512i* isums) {
  constexpr int kChains = kRows >= 3 ? 1 : 4 / kRows;
  const __m512i planes = _mm512_loadu_si512(block + 64 * kH), two_bits = _mm512_set1_epi8(3);
  __m512i partial[kRows][kChains];
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < kChains; ++c) partial[r][c] = _mm512_setzero_si512();
  }
  constexpr int kI = 4 * kH;
  dot_rows<kRows, kChains>(kI, _mm512_and_si512(planes, two_bits), j, x, partial);
  dot_rows<kRows, kChains>(kI + 1, _mm512_and_si512(_mm512_srli_epi16(planes, 2), two_bits), j, x, partial);
  dot_rows<kRows, kChains>(kI + 2, _mm512_and_si512(_mm512_srli_epi16(planes, 4), two_bits), j, x, partial);
  dot_rows<kRows, kChains>(kI + 3, _mm512_and_si512(_mm512_srli_epi16(planes, 6), two_bits), j, x, partial);
  for (int r = 0; r < kRows; ++r) {
    isums[r] = partial[r][0];  // integer adds: exact in any order
    for (int c = 1; c < kChains; ++c) isums[r] = _mm512_add_epi32(isums[r], partial[r][c]);
  }
}

// Block i of a K2-tile super-block (block j of the row) for kRows rows into lane kLane: k2_tiles_portable's
// float steps, the scales d * sc and biases -dmin * m from the sub-blocks' sc | m << 4 bytes.
template <int kRows, int kLane>
GMLX_AVX512_VNNI inline __attribute__((always_inline)) void k2_block_avx512(const uint8_t* super, int i, int64_t j,
                                                                          __m512 d, __m512 neg_dmin,
                                                                          const RowsOf<kRows>& x,
                                                                          __m512 (*lanes)[kLanes]) {
  __m512i sums[2][kRows];
  k2_sub_block_isums<kRows, 0>(k2_block(super, i), j, x, sums[0]);
  k2_sub_block_isums<kRows, 1>(k2_block(super, i), j, x, sums[1]);
  __m512 scales[2], biases[2];
  for (int h = 0; h < 2; ++h) {
    const auto* packed = reinterpret_cast<const __m128i*>(super + 4 * kTileOutputs + kTileOutputs * (2 * i + h));
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(packed));
    scales[h] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0F))));
    biases[h] = _mm512_mul_ps(neg_dmin, _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)));
  }
  for (int r = 0; r < kRows; ++r) {
    const __m512 t = _mm512_fmadd_ps(scales[0], _mm512_cvtepi32_ps(sums[0][r]),
                                     _mm512_mul_ps(scales[1], _mm512_cvtepi32_ps(sums[1][r])));
    __m512& lane = lanes[r][kLane];
    lane = _mm512_fmadd_ps(_mm512_set1_ps(x.d[r][j]), t, lane);
    lane = _mm512_fmadd_ps(biases[0], _mm512_set1_ps(x.half_xsd[r][2 * j]), lane);
    lane = _mm512_fmadd_ps(biases[1], _mm512_set1_ps(x.half_xsd[r][2 * j + 1]), lane);
  }
}

// Block i of a K-tile or K5-tile super-block (block j of the row) for kRows rows into lane kLane:
// its scales d * sc and biases dmin * m negated, from the super-block's d and -dmin (float32, exact products);
// a K2-tile's block by k2_block_avx512.
template <int kBits, int kRows, int kLane, bool kGfni>
GMLX_AVX512_VNNI inline __attribute__((always_inline)) void k4_block_avx512(const uint8_t* super, int i, int64_t j,
                                                                          __m512 d, __m512 neg_dmin,
                                                                          const RowsOf<kRows>& x,
                                                                          __m512 (*lanes)[kLanes]) {
  if constexpr (kBits == kK2Bits) {
    k2_block_avx512<kRows, kLane>(super, i, j, d, neg_dmin, x, lanes);
  } else {
    __m512i isums[kRows];
    if constexpr (kBits == kK4Bits) {
      block_isums<4, kRows>(k4_block<kBits>(super, i), j, x, isums);
    } else {
      k5_block_isums<kRows, kGfni>(k4_block<kBits>(super, i), j, x, isums);
    }
    const uint8_t* sub_scales = super + 4 * kTileOutputs + kTileOutputs * i;
    const uint8_t* sub_mins = sub_scales + kTileOutputs * kBlocksPerSuper;
    add_floats<kRows, kLane>(_mm512_mul_ps(d, widen(sub_scales)), _mm512_mul_ps(neg_dmin, widen(sub_mins)), j, x,
                             isums, lanes);
  }
}

// Every tile of [begin, end) for rows [r0, r0 + kRows), outputs written; one pointer walks
// the stream, four blocks a step so each block's lane is known at compile time.
template <int kBits, int kRows, bool kGfni = false>
GMLX_AVX512_VNNI void tiles_avx512(const QmmArgs& a, const QuantizedRows& x, int64_t begin, int64_t end, int64_t r0) {
  constexpr int64_t kBlockBytes = tile_block_bytes(kBits);
  const int64_t num_blocks = a.num_inputs / kInt8BlockInputs;
  // Only the first row group streams from memory: later groups (a prompt's rows) re-read this
  // thread's part of the weights from cache, where prefetches cost a prefill chunk ~4%.
  const int64_t prefetch_bytes = r0 == 0 ? tile_prefetch_blocks() * kBlockBytes : 0;
  const RowsOf<kRows> rows(x, r0);
  const uint8_t* block = a.quads + begin / kTileOutputs * tile_bytes(a.num_inputs, kBits);
  for (int64_t n0 = begin; n0 < end; n0 += kTileOutputs) {
    __m512 lanes[kRows][kLanes] = {};  // +0.0f each
    int64_t j = 0;
    for (; j + kLanes <= num_blocks; j += kLanes, block += kLanes * kBlockBytes) {
      prefetch_ahead(block, kLanes * kBlockBytes, prefetch_bytes);
      tile_block_avx512<kBits, kRows, 0, kGfni>(block, j, rows, lanes);
      tile_block_avx512<kBits, kRows, 1, kGfni>(block + kBlockBytes, j + 1, rows, lanes);
      tile_block_avx512<kBits, kRows, 2, kGfni>(block + 2 * kBlockBytes, j + 2, rows, lanes);
      tile_block_avx512<kBits, kRows, 3, kGfni>(block + 3 * kBlockBytes, j + 3, rows, lanes);
    }
    const int64_t num_left = num_blocks - j;
    if (num_left > 0) tile_block_avx512<kBits, kRows, 0, kGfni>(block, j, rows, lanes);
    if (num_left > 1) tile_block_avx512<kBits, kRows, 1, kGfni>(block + kBlockBytes, j + 1, rows, lanes);
    if (num_left > 2) tile_block_avx512<kBits, kRows, 2, kGfni>(block + 2 * kBlockBytes, j + 2, rows, lanes);
    block += num_left * kBlockBytes;
    store_tile_rows<kRows>(a, r0, n0, end, lanes);
  }
}

// A K-tile, K5-tile or K2-tile super-block's eight blocks (blocks j.. of the row) for kRows rows: d and -dmin
// read once.
template <int kBits, int kRows, bool kGfni>
GMLX_AVX512_VNNI inline __attribute__((always_inline)) void k4_super_avx512(const uint8_t* super, int64_t j,
                                                                          const RowsOf<kRows>& x,
                                                                          __m512 (*lanes)[kLanes]) {
  const auto* halves = reinterpret_cast<const __m256i*>(super);
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(halves));
  const __m512 neg_dmin = _mm512_mul_ps(_mm512_set1_ps(-1.0f), _mm512_cvtph_ps(_mm256_loadu_si256(halves + 1)));
  k4_block_avx512<kBits, kRows, 0, kGfni>(super, 0, j, d, neg_dmin, x, lanes);
  k4_block_avx512<kBits, kRows, 1, kGfni>(super, 1, j + 1, d, neg_dmin, x, lanes);
  k4_block_avx512<kBits, kRows, 2, kGfni>(super, 2, j + 2, d, neg_dmin, x, lanes);
  k4_block_avx512<kBits, kRows, 3, kGfni>(super, 3, j + 3, d, neg_dmin, x, lanes);
  k4_block_avx512<kBits, kRows, 0, kGfni>(super, 4, j + 4, d, neg_dmin, x, lanes);
  k4_block_avx512<kBits, kRows, 1, kGfni>(super, 5, j + 5, d, neg_dmin, x, lanes);
  k4_block_avx512<kBits, kRows, 2, kGfni>(super, 6, j + 6, d, neg_dmin, x, lanes);
  k4_block_avx512<kBits, kRows, 3, kGfni>(super, 7, j + 7, d, neg_dmin, x, lanes);
}

// A K6 block's sub-block h (weight vectors 4h..4h+3) summed against kRows rows' x, less 32 times
// x's sum there (quantize_rows's half sums, the chains' start): each vector's low nibbles as a
// 4-bit tile's, its top 2 bits (bits 2 (i % 4) of the block's high bytes i / 4) moved to bits 4-5
// and merged in by one ternary-logic op.
template <int kRows, bool kGfni>
GMLX_AVX512_VNNI inline __attribute__((always_inline)) void k6_sub_block_isums(const uint8_t* block, int h, int64_t j,
                                                                             const RowsOf<kRows>& x, __m512i* isums) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i high = _mm512_loadu_si512(block + kBlockWeightBytes4 + 64 * h);
  __m512i tops[4];
  if constexpr (kGfni) {
    tops[0] = move_bits_gfni<0, 2>(high), tops[1] = move_bits_gfni<2, 2>(high);
    tops[2] = move_bits_gfni<4, 2>(high), tops[3] = move_bits_gfni<6, 2>(high);
  } else {
    const __m512i top = _mm512_set1_epi8(0x30);
    tops[0] = _mm512_and_si512(_mm512_slli_epi16(high, 4), top);
    tops[1] = _mm512_and_si512(_mm512_slli_epi16(high, 2), top);
    tops[2] = _mm512_and_si512(high, top);
    tops[3] = _mm512_and_si512(_mm512_srli_epi16(high, 2), top);
  }
  constexpr int kChains = kRows >= 3 ? 1 : 4 / kRows;
  constexpr int kSelectNibble = 0xD8;  // c ? b : a, bit by bit: a = tops, b = the nibbles' byte, c = 0x0F
  __m512i partial[kRows][kChains];
  for (int r = 0; r < kRows; ++r) {
    partial[r][0] = _mm512_set1_epi32(-32 * x.half_sums[r][2 * j + h]);
    for (int c = 1; c < kChains; ++c) partial[r][c] = _mm512_setzero_si512();
  }
  for (int t = 2 * h; t < 2 * h + 2; ++t) {  // 64 bytes of nibbles: vectors 2t (low) and 2t + 1 (high)
    const __m512i v = _mm512_loadu_si512(block + 64 * t);
    const __m512i pair[2] = {_mm512_ternarylogic_epi32(tops[(2 * t) % 4], v, nibble, kSelectNibble),
                             _mm512_ternarylogic_epi32(tops[(2 * t + 1) % 4], _mm512_srli_epi16(v, 4), nibble,
                                                       kSelectNibble)};
    for (int r = 0; r < kRows; ++r) {
      const int8_t* xq = x.q[r] + j * kInt8BlockInputs;
      for (int e = 0; e < 2; ++e) {
        const int i = 2 * t + e;
        partial[r][i % kChains] = dot_broadcast(partial[r][i % kChains], pair[e], xq + 4 * i);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    isums[r] = partial[r][0];  // integer adds: exact in any order
    for (int c = 1; c < kChains; ++c) isums[r] = _mm512_add_epi32(isums[r], partial[r][c]);
  }
}

// A K3-tile block's sub-block kH (weight vectors 4kH..4kH+3: the 64 bytes of low 2 bits at 64 kH) summed
// against kRows rows' x, less 4 times x's sum there: each vector's 2 bits shifted down, its third bit
// (bit i of the 64 bytes at 128) merged in as bit 2.
template <int kRows, bool kGfni, int kH>
GMLX_AVX512_VNNI inline __attribute__((always_inline)) void k3_sub_block_isums(const uint8_t* block, int64_t j,
                                                                             const RowsOf<kRows>& x, __m512i* isums) {
  constexpr int kChains = kRows >= 3 ? 1 : 4 / kRows;
  const __m512i planes = _mm512_loadu_si512(block + 64 * kH), thirds = _mm512_loadu_si512(block + 2 * 64);
  __m512i partial[kRows][kChains];
  for (int r = 0; r < kRows; ++r) {
    partial[r][0] = _mm512_set1_epi32(-4 * x.half_sums[r][2 * j + kH]);
    for (int c = 1; c < kChains; ++c) partial[r][c] = _mm512_setzero_si512();
  }
  constexpr int kI = 4 * kH;
  dot_rows<kRows, kChains>(kI, with_top_bit<kI, kGfni, 2>(planes, thirds), j, x, partial);
  dot_rows<kRows, kChains>(kI + 1, with_top_bit<kI + 1, kGfni, 2>(_mm512_srli_epi16(planes, 2), thirds), j, x,
                           partial);
  dot_rows<kRows, kChains>(kI + 2, with_top_bit<kI + 2, kGfni, 2>(_mm512_srli_epi16(planes, 4), thirds), j, x,
                           partial);
  dot_rows<kRows, kChains>(kI + 3, with_top_bit<kI + 3, kGfni, 2>(_mm512_srli_epi16(planes, 6), thirds), j, x,
                           partial);
  for (int r = 0; r < kRows; ++r) {
    isums[r] = partial[r][0];  // integer adds: exact in any order
    for (int c = 1; c < kChains; ++c) isums[r] = _mm512_add_epi32(isums[r], partial[r][c]);
  }
}

// Block i of a K6-tile (K3-tile) super-block (block j of the row) for kRows rows into lane kLane: with A
// and B its sub-blocks' sums, t = s_b * float(B), t = fma(s_a, float(A), t), then fma(d_j, t, lane).
template <int kBits, int kRows, int kLane, bool kGfni>
GMLX_AVX512_VNNI inline __attribute__((always_inline)) void k6_block_avx512(const uint8_t* super, int i, int64_t j,
                                                                          __m512 d, const RowsOf<kRows>& x,
                                                                          __m512 (*lanes)[kLanes]) {
  __m512i sums[2][kRows];
  __m512 scales[2];
  if constexpr (kBits == kK3Bits) {
    k3_sub_block_isums<kRows, kGfni, 0>(k6_block<kBits>(super, i), j, x, sums[0]);
    k3_sub_block_isums<kRows, kGfni, 1>(k6_block<kBits>(super, i), j, x, sums[1]);
  }
  for (int h = 0; h < 2; ++h) {
    if constexpr (kBits == kK6Bits) k6_sub_block_isums<kRows, kGfni>(k6_block<kBits>(super, i), h, j, x, sums[h]);
    const auto* sub_scales = reinterpret_cast<const __m128i*>(super + 2 * kTileOutputs + kTileOutputs * (2 * i + h));
    scales[h] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(sub_scales))));
  }
  for (int r = 0; r < kRows; ++r) {
    const __m512 t = _mm512_fmadd_ps(scales[0], _mm512_cvtepi32_ps(sums[0][r]),
                                     _mm512_mul_ps(scales[1], _mm512_cvtepi32_ps(sums[1][r])));
    lanes[r][kLane] = _mm512_fmadd_ps(_mm512_set1_ps(x.d[r][j]), t, lanes[r][kLane]);
  }
}

// A K6-tile (K3-tile) super-block's eight blocks (blocks j.. of the row) for kRows rows: d read once.
template <int kBits, int kRows, bool kGfni>
GMLX_AVX512_VNNI inline __attribute__((always_inline)) void k6_super_avx512(const uint8_t* super, int64_t j,
                                                                          const RowsOf<kRows>& x,
                                                                          __m512 (*lanes)[kLanes]) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(super)));
  k6_block_avx512<kBits, kRows, 0, kGfni>(super, 0, j, d, x, lanes);
  k6_block_avx512<kBits, kRows, 1, kGfni>(super, 1, j + 1, d, x, lanes);
  k6_block_avx512<kBits, kRows, 2, kGfni>(super, 2, j + 2, d, x, lanes);
  k6_block_avx512<kBits, kRows, 3, kGfni>(super, 3, j + 3, d, x, lanes);
  k6_block_avx512<kBits, kRows, 0, kGfni>(super, 4, j + 4, d, x, lanes);
  k6_block_avx512<kBits, kRows, 1, kGfni>(super, 5, j + 5, d, x, lanes);
  k6_block_avx512<kBits, kRows, 2, kGfni>(super, 6, j + 6, d, x, lanes);
  k6_block_avx512<kBits, kRows, 3, kGfni>(super, 7, j + 7, d, x, lanes);
}

// tiles_avx512 over a K layout (kBits kK2Bits to kK6Bits), a super-block of eight blocks a step; kGfni:
// K3-, K5- and K6-tiles' top bits by GFNI (K6's below four rows).
template <int kBits, int kRows, bool kGfni = false>
GMLX_AVX512_VNNI void k_tiles_avx512(const QmmArgs& a, const QuantizedRows& x, int64_t begin, int64_t end,
                                     int64_t r0) {
  constexpr int64_t kSuperBytes = k_super_bytes(kBits);
  const int64_t num_blocks = a.num_inputs / kInt8BlockInputs;
  const int64_t prefetch_bytes = r0 == 0 ? tile_prefetch_blocks() * kSuperBytes / kBlocksPerSuper : 0;
  const RowsOf<kRows> rows(x, r0);
  const uint8_t* super = a.quads + begin / kTileOutputs * tile_bytes(a.num_inputs, kBits);
  for (int64_t n0 = begin; n0 < end; n0 += kTileOutputs) {
    __m512 lanes[kRows][kLanes] = {};  // +0.0f each
    for (int64_t j = 0; j < num_blocks; j += kBlocksPerSuper, super += kSuperBytes) {
      prefetch_ahead(super, kSuperBytes, prefetch_bytes);
      if constexpr (kBits == kK6Bits) {
        // Four rows of K6 sums with GFNI's four matrices ran 0.89x the shifts (3 rows 1.13x, 1-2 level).
        k6_super_avx512<kBits, kRows, kGfni && kRows < 4>(super, j, rows, lanes);
      } else if constexpr (kBits == kK3Bits) {
        k6_super_avx512<kBits, kRows, kGfni>(super, j, rows, lanes);
      } else {
        k4_super_avx512<kBits, kRows, kGfni>(super, j, rows, lanes);
      }
    }
    store_tile_rows<kRows>(a, r0, n0, end, lanes);
  }
}

template <int kBits, int kRows>
struct Avx512TileWalk {
  static void run(const QmmArgs& a, const QuantizedRows& x, int64_t begin, int64_t end, int64_t r0) {
    if constexpr (is_k_layout(kBits)) {
      k_tiles_avx512<kBits, kRows>(a, x, begin, end, r0);
    } else {
      tiles_avx512<kBits, kRows>(a, x, begin, end, r0);
    }
  }
};

// 5-bit tiles, K5- and K6-tiles with their top bits moved by GFNI (is_gfni_enabled).
template <int kBits, int kRows>
struct Avx512GfniWalk {
  static_assert(kBits == kFiveBits || kBits == kK3Bits || kBits == kK5Bits || kBits == kK6Bits);
  static void run(const QmmArgs& a, const QuantizedRows& x, int64_t begin, int64_t end, int64_t r0) {
    if constexpr (kBits == kFiveBits) {
      tiles_avx512<kBits, kRows, true>(a, x, begin, end, r0);
    } else {
      k_tiles_avx512<kBits, kRows, true>(a, x, begin, end, r0);
    }
  }
};

// ---------------------------------------------------------------- AVX2
// CPUs without VNNI take a tile as two halves of 8 outputs (one ymm of each 64-byte vector).
// maddubs of a vector's nibbles against four of x's bytes broadcast leaves each output's two
// pair sums in its own dword, so as with vpdpbusd no sum crosses outputs: a block's eight
// maddubs add as int16 (each pair at most 2 * 15 * 127, eight of them 30480) and one madd
// makes the block sums. 8-bit bytes split into nibbles, high sums shifted by 4 as int32.

// Block j's integer sums of a tile half (`half` 0 or 1: outputs 8 * half on) for kRows rows.
template <int kBits, int kRows>
GMLX_AVX2_F16C inline __attribute__((always_inline)) void half_block_isums(const uint8_t* block, int half, int64_t j,
                                                                         const RowsOf<kRows>& x, __m256i* isums) {
  constexpr int kNumVectors = kBits == 4 ? 4 : 8;  // 64-byte weight loads a block
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256i low[kRows], high[kRows];  // int16 pair sums: 4 bits both nibbles', 8 bits apart
  for (int r = 0; r < kRows; ++r) low[r] = high[r] = _mm256_setzero_si256();
  for (int t = 0; t < kNumVectors; ++t) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * t + 32 * half));
    const __m256i lo = _mm256_and_si256(v, nibble);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
    for (int r = 0; r < kRows; ++r) {
      const int8_t* xq = x.q[r] + j * kInt8BlockInputs;
      int32_t four_lo, four_hi;
      if constexpr (kBits == 4) {  // vector t: inputs 8t..8t+3 low, 8t+4..8t+7 high
        std::memcpy(&four_lo, xq + 8 * t, 4);
        std::memcpy(&four_hi, xq + 8 * t + 4, 4);
        low[r] = _mm256_add_epi16(low[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(four_lo)));
        low[r] = _mm256_add_epi16(low[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(four_hi)));
      } else {  // vector t: inputs 4t..4t+3, a byte's nibbles apart
        std::memcpy(&four_lo, xq + 4 * t, 4);
        const __m256i four = _mm256_set1_epi32(four_lo);
        low[r] = _mm256_add_epi16(low[r], _mm256_maddubs_epi16(lo, four));
        high[r] = _mm256_add_epi16(high[r], _mm256_maddubs_epi16(hi, four));
      }
    }
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < kRows; ++r) {
    isums[r] = _mm256_madd_epi16(low[r], ones);
    if constexpr (kBits == 8) {
      isums[r] = _mm256_add_epi32(isums[r], _mm256_slli_epi32(_mm256_madd_epi16(high[r], ones), 4));
    }
  }
}

// Block j's float steps of a tile half for kRows rows, into lane kLane (add_floats' on 8 outputs).
template <int kRows, int kLane>
GMLX_AVX2_F16C inline __attribute__((always_inline)) void add_half_floats(__m256 s, __m256 b, int64_t j,
                                                                        const RowsOf<kRows>& x, const __m256i* isums,
                                                                        __m256 (*lanes)[kLanes]) {
  for (int r = 0; r < kRows; ++r) {
    const __m256 p = _mm256_mul_ps(_mm256_set1_ps(x.d[r][j]), _mm256_cvtepi32_ps(isums[r]));
    __m256& lane = lanes[r][kLane];
    lane = _mm256_fmadd_ps(s, p, lane);
    lane = _mm256_fmadd_ps(b, _mm256_set1_ps(x.xsd[r][j]), lane);
  }
}

// Block j of a tile half for kRows rows into lane kLane, with the block's float16 scales and biases.
template <int kBits, int kRows, int kLane>
GMLX_AVX2_F16C inline __attribute__((always_inline)) void tile_half_block_avx2(const uint8_t* block, int half,
                                                                             int64_t j, const RowsOf<kRows>& x,
                                                                             __m256 (*lanes)[kLanes]) {
  constexpr int64_t kWeightBytes = kTileOutputs * kInt8BlockInputs * kBits / 8;
  __m256i isums[kRows];
  half_block_isums<kBits, kRows>(block, half, j, x, isums);
  const auto* halves = reinterpret_cast<const __m128i*>(block + kWeightBytes);
  const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(halves + half));
  const __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(halves + 2 + half));
  add_half_floats<kRows, kLane>(s, b, j, x, isums, lanes);
}

// Block i of a K-tile super-block (block j of the row), one half, for kRows rows into lane kLane.
template <int kRows, int kLane>
GMLX_AVX2_F16C inline __attribute__((always_inline)) void k4_half_block_avx2(const uint8_t* super, int i, int half,
                                                                           int64_t j, __m256 d, __m256 neg_dmin,
                                                                           const RowsOf<kRows>& x,
                                                                           __m256 (*lanes)[kLanes]) {
  __m256i isums[kRows];
  half_block_isums<4, kRows>(k4_block<kK4Bits>(super, i), half, j, x, isums);
  const uint8_t* sub_scales = super + 4 * kTileOutputs + kTileOutputs * i + 8 * half;
  const uint8_t* sub_mins = sub_scales + kTileOutputs * kBlocksPerSuper;
  const __m256 s = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                                        reinterpret_cast<const __m128i*>(sub_scales)))));
  const __m256 b = _mm256_mul_ps(neg_dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                                               reinterpret_cast<const __m128i*>(sub_mins)))));
  add_half_floats<kRows, kLane>(s, b, j, x, isums, lanes);
}

// A tile's blocks from `block` on for kRows rows, one half of their outputs, into lanes; four
// blocks a step so each block's lane is known at compile time.
template <int kBits, int kRows>
GMLX_AVX2_F16C inline __attribute__((always_inline)) void tile_blocks_avx2(const uint8_t* block, int64_t num_blocks,
                                                                         int half, const RowsOf<kRows>& x,
                                                                         int64_t prefetch_bytes,
                                                                         __m256 (*lanes)[kLanes]) {
  constexpr int64_t kBlockBytes = tile_block_bytes(kBits);
  int64_t j = 0;
  for (; j + kLanes <= num_blocks; j += kLanes, block += kLanes * kBlockBytes) {
    prefetch_ahead(block, kLanes * kBlockBytes, prefetch_bytes);
    tile_half_block_avx2<kBits, kRows, 0>(block, half, j, x, lanes);
    tile_half_block_avx2<kBits, kRows, 1>(block + kBlockBytes, half, j + 1, x, lanes);
    tile_half_block_avx2<kBits, kRows, 2>(block + 2 * kBlockBytes, half, j + 2, x, lanes);
    tile_half_block_avx2<kBits, kRows, 3>(block + 3 * kBlockBytes, half, j + 3, x, lanes);
  }
  const int64_t num_left = num_blocks - j;
  if (num_left > 0) tile_half_block_avx2<kBits, kRows, 0>(block, half, j, x, lanes);
  if (num_left > 1) tile_half_block_avx2<kBits, kRows, 1>(block + kBlockBytes, half, j + 1, x, lanes);
  if (num_left > 2) tile_half_block_avx2<kBits, kRows, 2>(block + 2 * kBlockBytes, half, j + 2, x, lanes);
}

// Every tile of [begin, end) for rows [r0, r0 + kRows), outputs written: each tile walked once
// per half, which keeps a half's 4 lanes a row in registers at 4 rows (one pass over both
// halves spilled them: 0.6x); the second pass reads the tile from cache and fetches the next.
template <int kBits, int kRows>
GMLX_AVX2_F16C void tiles_avx2(const QmmArgs& a, const QuantizedRows& x, int64_t begin, int64_t end, int64_t r0) {
  constexpr int64_t kBlockBytes = tile_block_bytes(kBits);
  const int64_t num_blocks = a.num_inputs / kInt8BlockInputs;
  const int64_t prefetch_bytes = r0 == 0 ? tile_prefetch_blocks() * kBlockBytes : 0;
  const int64_t tile_stride = num_blocks * kBlockBytes;
  const RowsOf<kRows> rows(x, r0);
  const uint8_t* tile = a.quads + begin / kTileOutputs * tile_stride;
  for (int64_t n0 = begin; n0 < end; n0 += kTileOutputs, tile += tile_stride) {
    __m256 lanes[2][kRows][kLanes];
    for (int h = 0; h < 2; ++h) {
      for (int r = 0; r < kRows; ++r) {
        for (int k = 0; k < kLanes; ++k) lanes[h][r][k] = _mm256_setzero_ps();
      }
    }
    tile_blocks_avx2<kBits, kRows>(tile, num_blocks, 0, rows, prefetch_bytes, lanes[0]);
    tile_blocks_avx2<kBits, kRows>(tile, num_blocks, 1, rows, r0 == 0 ? tile_stride : 0, lanes[1]);
    const int num_valid = static_cast<int>(std::min<int64_t>(kTileOutputs, end - n0));
    for (int r = 0; r < kRows; ++r) {
      alignas(32) float values[kTileOutputs];
      for (int h = 0; h < 2; ++h) {
        const __m256* l = lanes[h][r];
        _mm256_store_ps(values + 8 * h, _mm256_add_ps(_mm256_add_ps(l[0], l[1]), _mm256_add_ps(l[2], l[3])));
      }
      float* out = a.y + (r0 + r) * a.num_outputs + n0;
      if (num_valid == kTileOutputs) {
        std::memcpy(out, values, sizeof(values));
      } else {
        for (int o = 0; o < num_valid; ++o) out[o] = values[o];
      }
    }
  }
}

// tiles_avx2 over the K-tile layout, each tile a half at a time as there.
template <int kRows>
GMLX_AVX2_F16C void k4_tiles_avx2(const QmmArgs& a, const QuantizedRows& x, int64_t begin, int64_t end, int64_t r0) {
  const int64_t num_supers = a.num_inputs / kSuperBlockInputs, tile_stride = tile_bytes(a.num_inputs, kK4Bits);
  const int64_t prefetch_bytes = r0 == 0 ? tile_prefetch_blocks() * kK4SuperBytes / kBlocksPerSuper : 0;
  const RowsOf<kRows> rows(x, r0);
  const uint8_t* tile = a.quads + begin / kTileOutputs * tile_stride;
  for (int64_t n0 = begin; n0 < end; n0 += kTileOutputs, tile += tile_stride) {
    alignas(32) float values[kRows][kTileOutputs];
    for (int h = 0; h < 2; ++h) {
      __m256 lanes[kRows][kLanes];
      for (int r = 0; r < kRows; ++r) {
        for (int k = 0; k < kLanes; ++k) lanes[r][k] = _mm256_setzero_ps();
      }
      const uint8_t* super = tile;
      for (int64_t j = 0; j < num_supers * kBlocksPerSuper; j += kBlocksPerSuper, super += kK4SuperBytes) {
        prefetch_ahead(super, kK4SuperBytes, h == 0 ? prefetch_bytes : 0);
        const auto* halves = reinterpret_cast<const __m128i*>(super);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(halves + h));
        const __m256 neg_dmin = _mm256_mul_ps(_mm256_set1_ps(-1.0f), _mm256_cvtph_ps(_mm_loadu_si128(halves + 2 + h)));
        k4_half_block_avx2<kRows, 0>(super, 0, h, j, d, neg_dmin, rows, lanes);
        k4_half_block_avx2<kRows, 1>(super, 1, h, j + 1, d, neg_dmin, rows, lanes);
        k4_half_block_avx2<kRows, 2>(super, 2, h, j + 2, d, neg_dmin, rows, lanes);
        k4_half_block_avx2<kRows, 3>(super, 3, h, j + 3, d, neg_dmin, rows, lanes);
        k4_half_block_avx2<kRows, 0>(super, 4, h, j + 4, d, neg_dmin, rows, lanes);
        k4_half_block_avx2<kRows, 1>(super, 5, h, j + 5, d, neg_dmin, rows, lanes);
        k4_half_block_avx2<kRows, 2>(super, 6, h, j + 6, d, neg_dmin, rows, lanes);
        k4_half_block_avx2<kRows, 3>(super, 7, h, j + 7, d, neg_dmin, rows, lanes);
      }
      for (int r = 0; r < kRows; ++r) {
        const __m256* l = lanes[r];
        _mm256_store_ps(values[r] + 8 * h, _mm256_add_ps(_mm256_add_ps(l[0], l[1]), _mm256_add_ps(l[2], l[3])));
      }
    }
    const int num_valid = static_cast<int>(std::min<int64_t>(kTileOutputs, end - n0));
    for (int r = 0; r < kRows; ++r) {
      std::memcpy(a.y + (r0 + r) * a.num_outputs + n0, values[r], num_valid * sizeof(float));
    }
  }
}

template <int kBits, int kRows>
struct Avx2TileWalk {
  static void run(const QmmArgs& a, const QuantizedRows& x, int64_t begin, int64_t end, int64_t r0) {
    if constexpr (kBits == kK4Bits) {
      k4_tiles_avx2<kRows>(a, x, begin, end, r0);
    } else {
      tiles_avx2<kBits, kRows>(a, x, begin, end, r0);
    }
  }
};

#if GMLX_HAS_AMX_BUILD

// ---------------------------------------------------------------- AMX
// A group of 8-16 rows: per block one tdpbsud sums every row's 32 x bytes against the block's
// eight weight vectors (the layout's vectors are B's rows as they are), the very int32 block sums
// the VNNI dots make, stored and read back for the VNNI path's float steps. Fewer rows lose to
// VNNI: a block's tile loads and store cost ~40 ns however few rows share it (a 2-core Sapphire
// Rapids-class VM: a SmolLM2 forward of 4 rows 0.93x on AMX; of 16 rows 1.19x, BENCHMARKS.md).

constexpr int kAmxMaxRows = 16;  // a tile's rows
constexpr int64_t kUnpackAhead = 4, kUnpackRing = 8;  // 4-bit blocks unpacked ahead, in a ring
constexpr int64_t kSumsRing = 2 * kLanes;  // blocks whose sums wait for their float steps

// ldtilecfg's 64-byte operand: palette 1, each tile register's rows and bytes a row.
struct alignas(64) AmxConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// A 4-bit block's eight weight vectors as bytes (low then high nibbles of each 64), B's rows.
GMLX_AMX inline __attribute__((always_inline)) void unpack_block(const uint8_t* block, uint8_t* out) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int t = 0; t < 4; ++t) {
    const __m512i v = _mm512_loadu_si512(block + 64 * t);
    _mm512_store_si512(out + 128 * t, _mm512_and_si512(v, nibble));
    _mm512_store_si512(out + 128 * t + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
  }
}

// Block j's sums for every row of the group into `sums` (kRows x 16 int32). Blocks alternate two
// sets of tile registers (kSet). A tile load of bytes just stored waits for the store to land, so
// 4-bit blocks are unpacked kUnpackAhead blocks ahead (block g of the call: ring slot g).
template <int kBits, int kSet>
GMLX_AMX inline __attribute__((always_inline)) void amx_block_sums(const uint8_t* block, int64_t j, const int8_t* x_q,
                                                                 int64_t x_stride, uint8_t (*unpacked)[512], int64_t g,
                                                                 const uint8_t* stream_end, int32_t* sums) {
  const uint8_t* weights = block;
  if constexpr (kBits == 4) {
    const uint8_t* ahead = block + kUnpackAhead * tile_block_bytes(4);
    if (ahead < stream_end) unpack_block(ahead, unpacked[(g + kUnpackAhead) % kUnpackRing]);
    weights = unpacked[g % kUnpackRing];
  }
  const int8_t* x_block = x_q + j * kInt8BlockInputs;
  // The intrinsics paste their tile numbers into the instruction: literals only.
  if constexpr (kSet == 0) {
    _tile_loadd(2, x_block, x_stride);
    _tile_loadd(4, weights, 64);
    _tile_zero(0);
    _tile_dpbsud(0, 2, 4);
    _tile_stored(0, sums, 64);
  } else {
    _tile_loadd(3, x_block, x_stride);
    _tile_loadd(5, weights, 64);
    _tile_zero(1);
    _tile_dpbsud(1, 3, 5);
    _tile_stored(1, sums, 64);
  }
}

// Block j's float steps for every row, from its stored sums, into lane kLane.
template <int kBits, int kRows, int kLane>
GMLX_AMX inline __attribute__((always_inline)) void amx_block_floats(const uint8_t* block, int64_t j,
                                                                   const RowsOf<kRows>& x, const int32_t* sums,
                                                                   __m512 (*lanes)[kLanes]) {
  __m512i isums[kRows];
  for (int r = 0; r < kRows; ++r) isums[r] = _mm512_load_si512(sums + kTileOutputs * r);
  add_block_floats<kBits, kRows, kLane>(block, j, x, isums, lanes);
}

// The float steps of the four blocks before block j (j a multiple of four, `block` its start),
// whose sums sit in the half of `sums` the blocks from j are not using; none before the first four.
template <int kBits, int kRows>
GMLX_AMX inline __attribute__((always_inline)) void amx_floats_of_previous_four(const uint8_t* block, int64_t j,
                                                                              const RowsOf<kRows>& x,
                                                                              int32_t (*sums)[kRows * kTileOutputs],
                                                                              __m512 (*lanes)[kLanes]) {
  constexpr int64_t kBlockBytes = tile_block_bytes(kBits), kSumInts = kRows * kTileOutputs;
  if (j < kLanes) return;
  const uint8_t* first = block - kLanes * kBlockBytes;
  const int32_t* before = sums[(j / kLanes + 1) % 2 * kLanes];
  amx_block_floats<kBits, kRows, 0>(first, j - kLanes, x, before, lanes);
  amx_block_floats<kBits, kRows, 1>(first + kBlockBytes, j - kLanes + 1, x, before + kSumInts, lanes);
  amx_block_floats<kBits, kRows, 2>(first + 2 * kBlockBytes, j - kLanes + 2, x, before + 2 * kSumInts, lanes);
  amx_block_floats<kBits, kRows, 3>(first + 3 * kBlockBytes, j - kLanes + 3, x, before + 3 * kSumInts, lanes);
}

// Every tile of [begin, end) for rows [r0, r0 + kRows) on AMX. A block's float steps run four
// blocks after its sums (they read the sums' store), so each tile ends with its last blocks'.
template <int kBits, int kRows>
GMLX_AMX void tiles_amx(const QmmArgs& a, const QuantizedRows& x, int64_t begin, int64_t end, int64_t r0) {
  constexpr int64_t kBlockBytes = tile_block_bytes(kBits), kSumInts = kRows * kTileOutputs;
  AmxConfig config;
  for (int t = 0; t < 2; ++t) {
    config.rows[t] = kRows, config.bytes_per_row[t] = 64;  // sums: kRows x 16 int32
    config.rows[2 + t] = kRows, config.bytes_per_row[2 + t] = kInt8BlockInputs;  // x's bytes
    config.rows[4 + t] = kVectorsPerBlock, config.bytes_per_row[4 + t] = 64;  // weight vectors
  }
  _tile_loadconfig(&config);
  alignas(64) uint8_t unpacked[kUnpackRing][512];
  alignas(64) int32_t sums[kSumsRing][kSumInts];
  const int64_t num_blocks = a.num_inputs / kInt8BlockInputs;
  const int64_t prefetch_bytes = r0 == 0 ? tile_prefetch_blocks() * kBlockBytes : 0;
  const RowsOf<kRows> rows(x, r0);
  const int64_t x_stride = x.padded_inputs;
  const uint8_t* block = a.quads + begin / kTileOutputs * tile_bytes(a.num_inputs, kBits);
  const uint8_t* stream_end = a.quads + (end + kTileOutputs - 1) / kTileOutputs * tile_bytes(a.num_inputs, kBits);
  if constexpr (kBits == 4) {
    for (int64_t i = 0; i < kUnpackAhead && block + i * kBlockBytes < stream_end; ++i) {
      unpack_block(block + i * kBlockBytes, unpacked[i]);
    }
  }
  int64_t g = 0;  // blocks of this call so far: the unpack ring's index
  for (int64_t n0 = begin; n0 < end; n0 += kTileOutputs) {
    __m512 lanes[kRows][kLanes] = {};  // +0.0f each
    int64_t j = 0;
    for (; j + kLanes <= num_blocks; j += kLanes, block += kLanes * kBlockBytes, g += kLanes) {
      prefetch_ahead(block, kLanes * kBlockBytes, prefetch_bytes);
      int32_t* now = sums[j / kLanes % 2 * kLanes];
      amx_block_sums<kBits, 0>(block, j, rows.q[0], x_stride, unpacked, g, stream_end, now);
      amx_block_sums<kBits, 1>(block + kBlockBytes, j + 1, rows.q[0], x_stride, unpacked, g + 1, stream_end,
                               now + kSumInts);
      amx_block_sums<kBits, 0>(block + 2 * kBlockBytes, j + 2, rows.q[0], x_stride, unpacked, g + 2, stream_end,
                               now + 2 * kSumInts);
      amx_block_sums<kBits, 1>(block + 3 * kBlockBytes, j + 3, rows.q[0], x_stride, unpacked, g + 3, stream_end,
                               now + 3 * kSumInts);
      amx_floats_of_previous_four<kBits, kRows>(block, j, rows, sums, lanes);
    }
    const int64_t num_left = num_blocks - j;
    int32_t* left = sums[j / kLanes % 2 * kLanes];
    if (num_left > 0) amx_block_sums<kBits, 0>(block, j, rows.q[0], x_stride, unpacked, g, stream_end, left);
    if (num_left > 1) {
      amx_block_sums<kBits, 1>(block + kBlockBytes, j + 1, rows.q[0], x_stride, unpacked, g + 1, stream_end,
                               left + kSumInts);
    }
    if (num_left > 2) {
      amx_block_sums<kBits, 0>(block + 2 * kBlockBytes, j + 2, rows.q[0], x_stride, unpacked, g + 2, stream_end,
                               left + 2 * kSumInts);
    }
    amx_floats_of_previous_four<kBits, kRows>(block, j, rows, sums, lanes);
    if (num_left > 0) amx_block_floats<kBits, kRows, 0>(block, j, rows, left, lanes);
    if (num_left > 1) amx_block_floats<kBits, kRows, 1>(block + kBlockBytes, j + 1, rows, left + kSumInts, lanes);
    if (num_left > 2) {
      amx_block_floats<kBits, kRows, 2>(block + 2 * kBlockBytes, j + 2, rows, left + 2 * kSumInts, lanes);
    }
    block += num_left * kBlockBytes;
    g += num_left;
    store_tile_rows<kRows>(a, r0, n0, end, lanes);
  }
  _tile_release();  // the thread's tile state back to init: context switches save none of it
}

// Rows [0, num_amx_rows) in groups of 8-16 rows on AMX.
template <int kBits>
void amx_row_groups(const QmmArgs& a, const QuantizedRows& x, int64_t begin, int64_t end, int64_t num_amx_rows) {
  for (int64_t r0 = 0; r0 < num_amx_rows; r0 += kAmxMaxRows) {
    switch (std::min<int64_t>(kAmxMaxRows, num_amx_rows - r0)) {
      case 8: tiles_amx<kBits, 8>(a, x, begin, end, r0); break;
      case 9: tiles_amx<kBits, 9>(a, x, begin, end, r0); break;
      case 10: tiles_amx<kBits, 10>(a, x, begin, end, r0); break;
      case 11: tiles_amx<kBits, 11>(a, x, begin, end, r0); break;
      case 12: tiles_amx<kBits, 12>(a, x, begin, end, r0); break;
      case 13: tiles_amx<kBits, 13>(a, x, begin, end, r0); break;
      case 14: tiles_amx<kBits, 14>(a, x, begin, end, r0); break;
      case 15: tiles_amx<kBits, 15>(a, x, begin, end, r0); break;
      case 16: tiles_amx<kBits, 16>(a, x, begin, end, r0); break;
      default: assert(false && "an AMX group holds 8-16 rows");
    }
  }
}

#endif  // GMLX_HAS_AMX_BUILD

#endif  // GMLX_X86

std::atomic<int> g_tile_layout{-1};  // -1: not chosen yet (where the CPU has VNNI)
std::atomic<int> g_amx{-1};  // set_amx's setting; -1: on where has_amx()

#if GMLX_HAS_AMX_BUILD
// Rows of a call that go to AMX: whole groups of 8-16 (a remainder under 8 goes to VNNI).
int64_t num_amx_rows(int64_t num_rows) {
  constexpr int64_t kMinRows = 8;
  if (num_rows < kMinRows) return 0;
  const int64_t remainder = num_rows % kAmxMaxRows;
  return remainder != 0 && remainder < kMinRows ? num_rows - remainder : num_rows;
}
#endif

}  // namespace

int64_t tile_prefetch_blocks() {
  const int64_t setting = prefetch_chunks();
  return setting >= 0 ? setting : is_intel_cpu() ? kIntelPrefetchBlocks : 0;
}

bool has_amx() {
#if GMLX_X86 && GMLX_HAS_AMX_BUILD && defined(__linux__)
  static const bool is_usable = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!has_avx512_vnni() || !__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool has_int8_tiles = ((edx >> 24) & 1) && ((edx >> 25) & 1);  // AMX-TILE, AMX-INT8
    // Linux hands a process the tiles' state only on request: arch_prctl(ARCH_REQ_XCOMP_PERM,
    // XFEATURE_XTILEDATA), refused by kernels before 5.16 and where the hypervisor hides it.
    constexpr int kReqXcompPerm = 0x1023, kXtileData = 18;
    if (!has_int8_tiles || syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) != 0) return false;
    // And the OS has switched the tile state on (XCR0 bits 17-18), or the first tile instruction faults.
    unsigned xcr0_low = 0, xcr0_high = 0;
    asm volatile("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
    return ((xcr0_low >> 17) & 3) == 3;
  }();
  return is_usable;
#else
  return false;
#endif
}

void set_amx(int setting) { g_amx.store(setting < 0 ? -1 : setting > 0 ? 1 : 0); }
int amx_setting() { return g_amx.load(); }
bool is_amx_enabled() { return g_amx.load() != 0 && has_amx(); }

void set_tile_layout(bool is_enabled) { g_tile_layout.store(is_enabled ? 1 : 0); }

// Quads stay the default without VNNI: on Zen 3 the AVX2 tile walk gives 0.81x their SmolLM2 decode
// and 0.84-0.87x their forwards of 1-16 positions (it beat them from 3 rows before session 35's quads).
bool tile_layout() {
  int value = g_tile_layout.load();
  if (value < 0) {
    const int chosen = has_avx512_vnni() ? 1 : 0;
    g_tile_layout.compare_exchange_strong(value, chosen);
    value = g_tile_layout.load();
  }
  return value == 1;
}

void tile_outputs(const QmmArgs& a, const QuantizedRows& rows, int64_t begin, int64_t end, Isa isa) {
  assert(begin % kTileOutputs == 0);
#if GMLX_X86
  if (isa == Isa::kAvx512 && has_avx512_vnni()) {
    int64_t first_vnni_row = 0;
    // No AMX walk for the K layouts yet: their rows all take VNNI.
    if (a.bits == kK4Bits) return walk_by_rows<Avx512TileWalk, kK4Bits>(a, rows, begin, end);
    if (a.bits == kFiveBits) {  // no AMX walk for these either
      return is_gfni_enabled() ? walk_by_rows<Avx512GfniWalk, kFiveBits>(a, rows, begin, end)
                               : walk_by_rows<Avx512TileWalk, kFiveBits>(a, rows, begin, end);
    }
    if (a.bits == kIq4Bits) return walk_by_rows<Avx512TileWalk, kIq4Bits>(a, rows, begin, end);
    if (a.bits == kK5Bits) {
      return is_gfni_enabled() ? walk_by_rows<Avx512GfniWalk, kK5Bits>(a, rows, begin, end)
                               : walk_by_rows<Avx512TileWalk, kK5Bits>(a, rows, begin, end);
    }
    if (a.bits == kK6Bits) {
      return is_gfni_enabled() ? walk_by_rows<Avx512GfniWalk, kK6Bits>(a, rows, begin, end)
                               : walk_by_rows<Avx512TileWalk, kK6Bits>(a, rows, begin, end);
    }
    if (a.bits == kK3Bits) {
      return is_gfni_enabled() ? walk_by_rows<Avx512GfniWalk, kK3Bits>(a, rows, begin, end)
                               : walk_by_rows<Avx512TileWalk, kK3Bits>(a, rows, begin, end);
    }
    if (a.bits == kK2Bits) return walk_by_rows<Avx512TileWalk, kK2Bits>(a, rows, begin, end);
#if GMLX_HAS_AMX_BUILD
    if (is_amx_enabled()) {
      first_vnni_row = num_amx_rows(a.num_rows);
      if (first_vnni_row > 0) {
        a.bits == 4 ? amx_row_groups<4>(a, rows, begin, end, first_vnni_row)
                    : amx_row_groups<8>(a, rows, begin, end, first_vnni_row);
      }
    }
#endif
    return a.bits == 4 ? walk_by_rows<Avx512TileWalk, 4>(a, rows, begin, end, first_vnni_row)
                        : walk_by_rows<Avx512TileWalk, 8>(a, rows, begin, end, first_vnni_row);
  }
  // 5-bit, IQ4 and K-tiles but Q4_K's are packed where the CPU has VNNI (cpu_kernels): other ISAs walk
  // them portably.
  const bool is_vnni_only = a.bits == kFiveBits || a.bits == kIq4Bits || (is_k_layout(a.bits) && a.bits != kK4Bits);
  if (isa != Isa::kPortable && has_f16c() && !is_vnni_only) {  // AVX-512 without VNNI too: the same integers
    if (a.bits == kK4Bits) return walk_by_rows<Avx2TileWalk, kK4Bits>(a, rows, begin, end);
    return a.bits == 4 ? walk_by_rows<Avx2TileWalk, 4>(a, rows, begin, end)
                        : walk_by_rows<Avx2TileWalk, 8>(a, rows, begin, end);
  }
#endif
  (void)isa;
  const auto walk = a.bits == kK4Bits   ? k4_tiles_portable<kK4Bits>
                   : a.bits == kK5Bits ? k4_tiles_portable<kK5Bits>
                   : a.bits == kK6Bits ? k6_tiles_portable<kK6Bits>
                   : a.bits == kK3Bits ? k6_tiles_portable<kK3Bits>
                   : a.bits == kK2Bits ? k2_tiles_portable
                                       : tiles_portable;
  walk(a, rows, begin, end);
}

void tile_row(const uint8_t* tiles, int64_t id, int64_t num_inputs, int bits, float* y) {
  if (bits == kK4Bits || bits == kK5Bits) {
    const int o = static_cast<int>(id % kTileOutputs);
    const uint8_t* super = tiles + id / kTileOutputs * tile_bytes(num_inputs, bits);
    for (int64_t j0 = 0; j0 < num_inputs; j0 += kSuperBlockInputs, super += k_super_bytes(bits)) {
      for (int i = 0; i < kBlocksPerSuper; ++i) {
        const ScaleBias sb = k4_scale_and_bias(super, i, o);
        for (int t = 0; t < kInt8BlockInputs; ++t) {
          const int q = bits == kK4Bits ? k4_weight<kK4Bits>(super, i, o, t) : k4_weight<kK5Bits>(super, i, o, t);
          y[j0 + i * kInt8BlockInputs + t] = sb.scale * static_cast<float>(q) + sb.bias;
        }
      }
    }
    return;
  }
  if (bits == kK2Bits) {
    const int o = static_cast<int>(id % kTileOutputs);
    const uint8_t* super = tiles + id / kTileOutputs * tile_bytes(num_inputs, bits);
    for (int64_t j0 = 0; j0 < num_inputs; j0 += kSuperBlockInputs, super += kK2SuperBytes) {
      for (int t = 0; t < kSuperBlockInputs; ++t) {
        const ScaleBias sub = k2_scale_and_bias(super, static_cast<int>(t / kSubBlockInputs), o);
        const int q = k2_weight(k2_block(super, t / kInt8BlockInputs), o, static_cast<int>(t % kInt8BlockInputs));
        y[j0 + t] = sub.scale * static_cast<float>(q) + sub.bias;
      }
    }
    return;
  }
  if (bits == kK6Bits || bits == kK3Bits) {
    const int o = static_cast<int>(id % kTileOutputs);
    const uint8_t* super = tiles + id / kTileOutputs * tile_bytes(num_inputs, bits);
    for (int64_t j0 = 0; j0 < num_inputs; j0 += kSuperBlockInputs, super += k_super_bytes(bits)) {
      for (int t = 0; t < kSuperBlockInputs; ++t) {
        const float scale = k6_scale(super, static_cast<int>(t / kSubBlockInputs), o);
        const int i = t / kInt8BlockInputs, in_block = t % kInt8BlockInputs;
        const int q = bits == kK6Bits ? k6_super_weight<kK6Bits>(super, i, o, in_block)
                                      : k6_super_weight<kK3Bits>(super, i, o, in_block);
        y[j0 + t] = scale * static_cast<float>(q - k_sub_block_offset(bits));
      }
    }
    return;
  }
  const int64_t block_bytes = tile_block_bytes(bits), weight_bytes = block_bytes - 4 * kTileOutputs;
  const int o = static_cast<int>(id % kTileOutputs);
  const uint8_t* block = tiles + id / kTileOutputs * tile_bytes(num_inputs, bits);
  for (int64_t j0 = 0; j0 < num_inputs; j0 += kInt8BlockInputs, block += block_bytes) {
    const auto* halves = reinterpret_cast<const uint16_t*>(block + weight_bytes);
    const float scale = half_to_float(halves[o]), bias = half_to_float(halves[kTileOutputs + o]);
    for (int t = 0; t < kInt8BlockInputs; ++t) {
      y[j0 + t] = scale * static_cast<float>(tile_weight(block, o, t, bits)) + bias;
    }
  }
}

}  // namespace gmlx_kernels
