#include "gguf_blocks.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "attention_job.h"
#include "huge_pages.h"
#include "int8_dot_kernels.h"
#include "isa_target.h"
#include "pack_layout.h"
#include "qmm_kernels.h"
#include "thread_pool.h"

namespace gmlx_kernels {

namespace {

constexpr int64_t kQ2KBytes = 84;  // 16 bytes of 4-bit scales and mins, 64 of 2-bit levels, float16 d and dmin
constexpr int64_t kQ3KBytes = 110;  // 32 bytes of third bits, 64 of low 2 bits, 12 of 6-bit scales, float16 d
constexpr int64_t kQ6KBytes = 210;  // 128 low-bit bytes, 64 high-bit bytes, 16 int8 scales, float16 d
constexpr int64_t kQ4KBytes = 144;  // float16 d and dmin, 12 bytes of 6-bit scales and mins, 128 of levels
constexpr int64_t kQ5KBytes = 176;  // Q4_K's with the levels' fifth bits (32 bytes) before the 128 of low bits
constexpr int64_t kBlockValues = 256;  // a K-quant super-block
constexpr int64_t kGroup = 32;

// float32 to float16 bits through mlx's half type (the KV cache's Half): rounded to nearest even,
// as numpy's astype(float16) rounds.
uint16_t float_to_half(float value) {
  const Half half(value);
  uint16_t bits;
  std::memcpy(&bits, &half, sizeof(bits));
  return bits;
}

// numpy's nextafter on a float16, toward -infinity (is_up false) or +infinity.
uint16_t next_half(uint16_t h, bool is_up) {
  if ((h & 0x7FFFu) > 0x7C00u) return h;  // NaN
  if ((h & 0x7FFFu) == 0) return is_up ? 0x0001u : 0x8001u;  // either zero: the smallest subnormal
  const bool is_negative = (h & 0x8000u) != 0;
  if (h == (is_up ? 0x7C00u : 0xFC00u)) return h;  // already that infinity
  return static_cast<uint16_t>(is_negative == is_up ? h - 1 : h + 1);
}

// A block's 256 values as the gguf package's dequantize gives them: (d * sc) * (q - 32) in
// float32. Value v of half h: low 4 bits in byte 64h + v % 64 (low nibble for v < 64), high 2
// bits at bit 2 (v / 32) of byte 32h + v % 32; sub-block scale (128h + v) / 16.
void q6_k_values(const uint8_t* block, float* values) {
  const auto* sub_scales = reinterpret_cast<const int8_t*>(block + 192);
  uint16_t d_bits;
  std::memcpy(&d_bits, block + 208, sizeof(d_bits));
  const float d = half_to_float(d_bits);
  for (int64_t half = 0; half < 2; ++half) {
    const uint8_t* low = block + 64 * half;
    const uint8_t* high = block + 128 + 32 * half;
    for (int64_t quarter = 0; quarter < 4; ++quarter) {  // 32 values: one shift of the high bits
      const float scale_a = d * static_cast<float>(sub_scales[8 * half + 2 * quarter]);
      const float scale_b = d * static_cast<float>(sub_scales[8 * half + 2 * quarter + 1]);
      float* out = values + 128 * half + 32 * quarter;
      const uint8_t* low_bytes = low + 32 * (quarter % 2);
      const int low_shift = quarter < 2 ? 0 : 4, high_shift = 2 * static_cast<int>(quarter);
      for (int64_t l = 0; l < 32; ++l) {
        const int q = ((low_bytes[l] >> low_shift) & 0x0F) | (((high[l] >> high_shift) & 3) << 4);
        out[l] = (l < 16 ? scale_a : scale_b) * static_cast<float>(q - 32);
      }
    }
  }
}

// Sub-block s (0-15) of a Q3_K block's 6-bit scales less 32: the low 4 bits the low (s < 8) or high
// nibble of byte s % 8, the top 2 at bits 2 (s / 4) of byte 8 + s % 4.
int q3_k_scale(const uint8_t* packed, int s) {
  const int low = (packed[s % 8] >> (s < 8 ? 0 : 4)) & 0x0F, top = (packed[8 + s % 4] >> (2 * (s / 4))) & 3;
  return (low | (top << 4)) - 32;
}

// Value v's 2-bit level of a Q2_K or Q3_K block's 64 bytes of them: bits 2 (v % 128 / 32) of byte
// 32 (v / 128) + v % 32.
int k_low_level(const uint8_t* levels, int v) { return (levels[32 * (v / 128) + v % 32] >> (2 * (v % 128 / 32))) & 3; }

// Value v's 3-bit level (0-7, the value's q + 4) of a Q3_K block: k_low_level of the 64 bytes from 32,
// its third bit at bit v / 32 of byte v % 32.
int q3_k_level(const uint8_t* block, int v) {
  return k_low_level(block + 32, v) | (((block[v % 32] >> (v / 32)) & 1) << 2);
}

// A block's 256 values as the gguf package's dequantize gives them: (d * sc) * q - dmin * m in float32,
// sc and m the low and high nibbles of byte v / 16.
void q2_k_values(const uint8_t* block, float* values) {
  uint16_t d_bits, dmin_bits;
  std::memcpy(&d_bits, block + 80, sizeof(d_bits));
  std::memcpy(&dmin_bits, block + 82, sizeof(dmin_bits));
  const float d = half_to_float(d_bits), dmin = half_to_float(dmin_bits);
  for (int v = 0; v < kBlockValues; ++v) {
    const float scale = d * static_cast<float>(block[v / 16] & 0x0F);
    const float bias = dmin * static_cast<float>(block[v / 16] >> 4);
    values[v] = scale * static_cast<float>(k_low_level(block + 16, v)) - bias;
  }
}

// A block's 256 values as the gguf package's dequantize gives them: (d * sc) * (q - 4) in float32,
// sub-block scale v / 16.
void q3_k_values(const uint8_t* block, float* values) {
  uint16_t d_bits;
  std::memcpy(&d_bits, block + 108, sizeof(d_bits));
  const float d = half_to_float(d_bits);
  for (int v = 0; v < kBlockValues; ++v) {
    const float scale = d * static_cast<float>(q3_k_scale(block + 96, v / 16));
    values[v] = scale * static_cast<float>(q3_k_level(block, v) - 4);
  }
}

// A group's float16 bias and scale (rounded outwards so that 256 levels span [low, high]) and
// the step its levels are rounded against: gguf_blocks.requantized's steps in the same order.
struct GroupGrid {
  uint16_t scale, bias;
  float bias_f, step;
};

GroupGrid group_grid(float low, float high) {
  GroupGrid grid{};
  grid.bias = float_to_half(low);
  if (half_to_float(grid.bias) > low) grid.bias = next_half(grid.bias, false);
  grid.bias_f = half_to_float(grid.bias);
  grid.scale = float_to_half((high - grid.bias_f) / 255.0f);
  const float reach = half_to_float(grid.scale) * 255.0f;
  if (reach + grid.bias_f < high) grid.scale = next_half(grid.scale, true);
  grid.step = (grid.scale & 0x7FFFu) == 0 ? 1.0f : half_to_float(grid.scale);
  return grid;
}

constexpr float kRound = 8388608.0f;  // 2^23: adding and taking it off rounds [0, 2^23) half to even, as np.round

// One group's 8-bit levels, scale and bias.
void requantize_group(const float* values, uint8_t* levels, uint16_t* scale_out, uint16_t* bias_out) {
  float low = values[0], high = values[0];
  for (int64_t i = 1; i < kGroup; ++i) low = std::min(low, values[i]), high = std::max(high, values[i]);
  const GroupGrid grid = group_grid(low, high);
  for (int64_t i = 0; i < kGroup; ++i) {
    const float x = (values[i] - grid.bias_f) / grid.step;
    const float level = x < 255.0f ? (x + kRound) - kRound : 255.0f;
    levels[i] = x > 0.0f ? static_cast<uint8_t>(level) : 0;  // clipped to [0, 255]; NaN: 0
  }
  *scale_out = grid.scale;
  *bias_out = grid.bias;
}

#if GMLX_X86
// A Q6_K block's 8 groups as q6_k_values and requantize_group make them, 8 values a vector: the
// same float operations on each value (a group's minimum and maximum are exact in any order),
// so the same bits: 1.2 ns a value against the scalar loops' 3.5 on a 2-core Zen 4.
GMLX_AVX2 void q6_k_block_avx2(const uint8_t* block, uint8_t* weight, uint16_t* scales, uint16_t* biases) {
  const auto* sub_scales = reinterpret_cast<const int8_t*>(block + 192);
  uint16_t d_bits;
  std::memcpy(&d_bits, block + 208, sizeof(d_bits));
  const float d = half_to_float(d_bits);
  const __m256i low_mask = _mm256_set1_epi8(0x0F), high_mask = _mm256_set1_epi8(3), offset = _mm256_set1_epi32(32);
  const __m256 top = _mm256_set1_ps(255.0f), round = _mm256_set1_ps(kRound), zero = _mm256_setzero_ps();
  const __m256i byte_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  for (int g = 0; g < 8; ++g) {  // group g: values 32g.. of half g / 4 (q6_k_values' layout)
    const int half = g / 4, quarter = g % 4;
    const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * half + 32 * (quarter % 2)));
    const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * half));
    const __m256i low_bits = _mm256_and_si256(_mm256_srl_epi16(low, _mm_cvtsi32_si128(quarter < 2 ? 0 : 4)), low_mask);
    const __m256i high_bits = _mm256_and_si256(_mm256_srl_epi16(high, _mm_cvtsi32_si128(2 * quarter)), high_mask);
    alignas(32) uint8_t q[32];
    _mm256_store_si256(reinterpret_cast<__m256i*>(q), _mm256_or_si256(low_bits, _mm256_slli_epi16(high_bits, 4)));
    __m256 values[4];
    for (int c = 0; c < 4; ++c) {  // 16 values a sub-block scale
      const __m256 scale = _mm256_set1_ps(d * static_cast<float>(sub_scales[8 * half + 2 * quarter + c / 2]));
      const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * c)));
      values[c] = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_sub_epi32(bytes, offset)));
    }
    alignas(32) float lows[8], highs[8];
    _mm256_store_ps(lows, _mm256_min_ps(_mm256_min_ps(values[0], values[1]), _mm256_min_ps(values[2], values[3])));
    _mm256_store_ps(highs, _mm256_max_ps(_mm256_max_ps(values[0], values[1]), _mm256_max_ps(values[2], values[3])));
    float group_low = lows[0], group_high = highs[0];
    for (int i = 1; i < 8; ++i) group_low = std::min(group_low, lows[i]), group_high = std::max(group_high, highs[i]);
    const GroupGrid grid = group_grid(group_low, group_high);
    const __m256 bias = _mm256_set1_ps(grid.bias_f), step = _mm256_set1_ps(grid.step);
    __m256i levels[4];
    for (int c = 0; c < 4; ++c) {
      const __m256 x = _mm256_div_ps(_mm256_sub_ps(values[c], bias), step);
      const __m256 rounded = _mm256_sub_ps(_mm256_add_ps(x, round), round);
      const __m256 level = _mm256_blendv_ps(top, rounded, _mm256_cmp_ps(x, top, _CMP_LT_OQ));
      levels[c] = _mm256_cvttps_epi32(_mm256_and_ps(level, _mm256_cmp_ps(x, zero, _CMP_GT_OQ)));  // NaN: 0
    }
    const __m256i words = _mm256_packus_epi16(_mm256_packus_epi32(levels[0], levels[1]),
                                              _mm256_packus_epi32(levels[2], levels[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(weight + 32 * g), _mm256_permutevar8x32_epi32(words, byte_order));
    scales[g] = grid.scale;
    biases[g] = grid.bias;
  }
}
#endif

// Sub-block s's 6-bit scale and min from a K-quant block's 12 packed bytes: sub-blocks 0-3 in the
// low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 in bytes 8-11's nibbles and the top 2 bits of bytes 0-7.
struct KScaleMin {
  uint8_t scale, min;
};

KScaleMin k_scale_and_min(const uint8_t* packed, int s) {
  if (s < 4) return {static_cast<uint8_t>(packed[s] & 63), static_cast<uint8_t>(packed[s + 4] & 63)};
  return {static_cast<uint8_t>((packed[s + 4] & 0x0F) | ((packed[s - 4] >> 6) << 4)),
          static_cast<uint8_t>((packed[s + 4] >> 4) | ((packed[s] >> 6) << 4))};
}

// A Q4_K or Q5_K block's 8 sub-blocks' float16(d * sc) and float16(-dmin * m), as gguf_blocks.py's
// _k_affine makes them.
void k_scales_and_biases(const uint8_t* block, uint16_t* scales, uint16_t* biases) {
  uint16_t d_bits, dmin_bits;
  std::memcpy(&d_bits, block, sizeof(d_bits));
  std::memcpy(&dmin_bits, block + 2, sizeof(dmin_bits));
  const float d = half_to_float(d_bits), dmin = half_to_float(dmin_bits);
  for (int s = 0; s < 8; ++s) {
    const KScaleMin sub = k_scale_and_min(block + 4, s);
    scales[s] = float_to_half(d * static_cast<float>(sub.scale));
    biases[s] = float_to_half(-dmin * static_cast<float>(sub.min));
  }
}

// A Q4_K block's 8 sub-blocks: 128 bytes of MLX-packed levels (byte j of a sub-block: levels 2j
// and 2j + 1) and k_scales_and_biases, as gguf_blocks.py's _q4_k makes them.
void q4_k_triplets(const uint8_t* block, uint8_t* weight, uint16_t* scales, uint16_t* biases) {
  k_scales_and_biases(block, scales, biases);
  const uint8_t* levels = block + 16;  // 32 bytes a pair of sub-blocks: the first in the low nibbles
  for (int pair = 0; pair < 4; ++pair, levels += 32, weight += 32) {
    for (int j = 0; j < 16; ++j) {
      const uint8_t even = levels[2 * j], odd = levels[2 * j + 1];
      weight[j] = static_cast<uint8_t>((even & 0x0F) | (odd << 4));
      weight[16 + j] = static_cast<uint8_t>((even >> 4) | (odd & 0xF0));
    }
  }
}

// Sub-block s's 32 levels of a Q4_K block (`fifths` null) or a Q5_K one: the low 4 bits the low
// (even s) or high nibbles of the 32 bytes at levels + 32 (s / 2); a Q5_K level's bit 4 at bit s of
// fifths[l].
void k_sub_block_levels(const uint8_t* levels, const uint8_t* fifths, int s, uint8_t* out) {
  const uint8_t* pair = levels + 32 * (s / 2);
  for (int l = 0; l < kGroup; ++l) {
    const int fifth = fifths == nullptr ? 0 : ((fifths[l] >> s) & 1) << 4;
    out[l] = static_cast<uint8_t>(((pair[l] >> (4 * (s % 2))) & 0x0F) | fifth);
  }
}

// A Q5_K block's 8 sub-blocks: 256 bytes of 8-bit levels (k_sub_block_levels of the 128 bytes from
// 48 and the fifth bits at 16) and k_scales_and_biases, as gguf_blocks.py's _q5_k makes them.
void q5_k_triplets(const uint8_t* block, uint8_t* weight, uint16_t* scales, uint16_t* biases) {
  k_scales_and_biases(block, scales, biases);
  for (int s = 0; s < 8; ++s) k_sub_block_levels(block + 48, block + 16, s, weight + kGroup * s);
}

struct DecodeJob {
  const uint8_t* blocks;
  uint8_t* weight;  // bytes: 128 a Q4_K block, 256 any other kind's
  uint16_t* scales;
  uint16_t* biases;
  int64_t blocks_per_row;
  KQuantKind kind;
  bool is_avx2;  // Q6_K blocks through q6_k_block_avx2 (the kernels' ISA is AVX2 or AVX-512)
};

KQuantKind parse_k_quant_kind(const std::string& kind, const std::string& who) {
  if (kind == "Q4_K") return KQuantKind::kQ4K;
  if (kind == "Q5_K") return KQuantKind::kQ5K;
  if (kind == "Q6_K") return KQuantKind::kQ6K;
  if (kind == "Q3_K") return KQuantKind::kQ3K;
  if (kind == "Q2_K") return KQuantKind::kQ2K;
  throw std::invalid_argument(who + ": kind " + kind + ": expected Q2_K, Q3_K, Q4_K, Q5_K or Q6_K");
}

int64_t k_quant_block_bytes(KQuantKind kind) {
  return kind == KQuantKind::kQ2K   ? kQ2KBytes
         : kind == KQuantKind::kQ3K ? kQ3KBytes
         : kind == KQuantKind::kQ4K ? kQ4KBytes
         : kind == KQuantKind::kQ5K ? kQ5KBytes
                                    : kQ6KBytes;
}

void decode_row(void* context, int64_t row) {
  const auto& job = *static_cast<const DecodeJob*>(context);
  float values[kBlockValues];
  for (int64_t b = 0; b < job.blocks_per_row; ++b) {
    const int64_t block = row * job.blocks_per_row + b, first_group = block * (kBlockValues / kGroup);
    if (job.kind == KQuantKind::kQ4K) {
      q4_k_triplets(job.blocks + block * kQ4KBytes, job.weight + block * kBlockValues / 2, job.scales + first_group,
                    job.biases + first_group);
      continue;
    }
    if (job.kind == KQuantKind::kQ5K) {
      q5_k_triplets(job.blocks + block * kQ5KBytes, job.weight + block * kBlockValues, job.scales + first_group,
                    job.biases + first_group);
      continue;
    }
    if (job.kind == KQuantKind::kQ2K || job.kind == KQuantKind::kQ3K) {
      if (job.kind == KQuantKind::kQ2K) {
        q2_k_values(job.blocks + block * kQ2KBytes, values);
      } else {
        q3_k_values(job.blocks + block * kQ3KBytes, values);
      }
      for (int64_t g = 0; g < kBlockValues / kGroup; ++g) {
        const int64_t group = first_group + g;
        requantize_group(values + g * kGroup, job.weight + group * kGroup, job.scales + group, job.biases + group);
      }
      continue;
    }
#if GMLX_X86
    if (job.is_avx2) {
      q6_k_block_avx2(job.blocks + block * kQ6KBytes, job.weight + first_group * kGroup, job.scales + first_group,
                      job.biases + first_group);
      continue;
    }
#endif
    q6_k_values(job.blocks + block * kQ6KBytes, values);
    for (int64_t g = 0; g < kBlockValues / kGroup; ++g) {
      const int64_t group = first_group + g;
      requantize_group(values + g * kGroup, job.weight + group * kGroup, job.scales + group, job.biases + group);
    }
  }
}

// A K-quant super-block of one row (`block`) into output o of a tile's super-block (`super`).
using PackSuperRow = void (*)(const uint8_t* block, int64_t o, uint8_t* super);

struct KPackJob {
  const uint8_t* blocks;
  uint8_t* tiles;
  int64_t num_rows, row_bytes, block_bytes, super_bytes;
  PackSuperRow pack_super_row;
};

// Tile t of a K layout from its 16 rows' blocks, zeros past the rows.
void pack_k_tile(void* context, int64_t t) {
  const auto& job = *static_cast<const KPackJob*>(context);
  const int64_t num_supers = job.row_bytes / job.block_bytes;
  uint8_t* super = job.tiles + t * num_supers * job.super_bytes;
  for (int64_t s = 0; s < num_supers; ++s, super += job.super_bytes) {
    std::memset(super, 0, job.super_bytes);
    for (int64_t o = 0; o < kTileOutputs && kTileOutputs * t + o < job.num_rows; ++o) {
      job.pack_super_row(job.blocks + (kTileOutputs * t + o) * job.row_bytes + s * job.block_bytes, o, super);
    }
  }
}

// A Q4_K or Q5_K block's header into a K-tile super-block: d, dmin, and the 6-bit scales and mins as bytes.
void pack_k_header(const uint8_t* block, int64_t o, uint8_t* super) {
  std::memcpy(super + 2 * o, block, 2);  // d
  std::memcpy(super + 2 * kTileOutputs + 2 * o, block + 2, 2);  // dmin
  uint8_t* sub_scales = super + 4 * kTileOutputs;
  uint8_t* sub_mins = sub_scales + kTileOutputs * (kBlockValues / kGroup);
  for (int i = 0; i < kBlockValues / kGroup; ++i) {
    const KScaleMin sub = k_scale_and_min(block + 4, i);
    sub_scales[kTileOutputs * i + o] = sub.scale;
    sub_mins[kTileOutputs * i + o] = sub.min;
  }
}

// A Q4_K block into the K-tile layout (int8_dot_kernels.h): each sub-block's levels where a 4-bit
// tile keeps them.
void pack_q4_k_row(const uint8_t* block, int64_t o, uint8_t* super) {
  pack_k_header(block, o, super);
  uint8_t levels[kGroup];
  for (int i = 0; i < kBlockValues / kGroup; ++i) {
    k_sub_block_levels(block + 16, nullptr, i, levels);
    pack_tile_levels(levels, o, super + kK4HeaderBytes + i * (kTileOutputs * kGroup / 2), 4);
  }
}

// A Q5_K block into the K5-tile layout: each sub-block's levels as a 5-bit tile block's.
void pack_q5_k_row(const uint8_t* block, int64_t o, uint8_t* super) {
  pack_k_header(block, o, super);
  uint8_t levels[kGroup];
  for (int i = 0; i < kBlockValues / kGroup; ++i) {
    k_sub_block_levels(block + 48, block + 16, i, levels);
    pack_tile_levels(levels, o, super + kK4HeaderBytes + i * kK5BlockBytes, kFiveBits);
  }
}

// A Q6_K block into the K6-tile layout: d, the int8 sub-block scales, and the 6-bit levels (as
// q6_k_values reads them) as pack_tile_levels places a K6-tile block's.
void pack_q6_k_row(const uint8_t* block, int64_t o, uint8_t* super) {
  std::memcpy(super + 2 * o, block + 208, 2);  // d
  for (int h = 0; h < kBlockValues / 16; ++h) super[2 * kTileOutputs + kTileOutputs * h + o] = block[192 + h];
  uint8_t levels[kBlockValues];
  for (int half = 0; half < 2; ++half) {
    for (int quarter = 0; quarter < 4; ++quarter) {
      const uint8_t* low = block + 64 * half + 32 * (quarter % 2);
      const uint8_t* high = block + 128 + 32 * half;
      const int low_shift = quarter < 2 ? 0 : 4, high_shift = 2 * quarter;
      for (int l = 0; l < 32; ++l) {
        levels[128 * half + 32 * quarter + l] =
            static_cast<uint8_t>(((low[l] >> low_shift) & 0x0F) | (((high[l] >> high_shift) & 3) << 4));
      }
    }
  }
  for (int i = 0; i < kBlockValues / kGroup; ++i) {
    pack_tile_levels(levels + kGroup * i, o, super + kK6HeaderBytes + i * kK6BlockBytes, kK6Bits);
  }
}

// Block i's 32 levels (values 32i..) of a Q2_K block (`thirds` null) or a Q3_K one, four a 32-bit word:
// 2 bits at bits 2 (i % 4) of the 32 bytes at lows + 32 (i / 4), a Q3_K level's third at bit i of thirds[l].
void k_plane_block_levels(const uint8_t* lows, const uint8_t* thirds, int i, uint8_t* out) {
  const uint8_t* bytes = lows + 32 * (i / 4);
  for (int w = 0; w < kGroup / 4; ++w) {
    uint32_t low, third = 0;
    std::memcpy(&low, bytes + 4 * w, sizeof(low));
    if (thirds != nullptr) std::memcpy(&third, thirds + 4 * w, sizeof(third));
    const uint32_t levels = ((low >> (2 * (i % 4))) & 0x03030303u) | (((third >> i) & 0x01010101u) << 2);
    std::memcpy(out + 4 * w, &levels, sizeof(levels));
  }
}

// A Q3_K block into the K3-tile layout: d, the sub-block scales less 32 as int8, and the 3-bit levels as
// pack_tile_levels places a K3-tile block's.
void pack_q3_k_row(const uint8_t* block, int64_t o, uint8_t* super) {
  std::memcpy(super + 2 * o, block + 108, 2);  // d
  for (int h = 0; h < kBlockValues / 16; ++h) {
    const auto scale = static_cast<int8_t>(q3_k_scale(block + 96, h));
    super[2 * kTileOutputs + kTileOutputs * h + o] = static_cast<uint8_t>(scale);
  }
  uint8_t levels[kGroup];
  for (int i = 0; i < kBlockValues / kGroup; ++i) {
    k_plane_block_levels(block + 32, block, i, levels);
    pack_tile_levels(levels, o, super + kK6HeaderBytes + i * kK3BlockBytes, kK3Bits);
  }
}

// A Q2_K block into the K2-tile layout: d, dmin, the sc | m << 4 bytes as they are, and the 2-bit levels
// as pack_tile_levels places a K2-tile block's.
void pack_q2_k_row(const uint8_t* block, int64_t o, uint8_t* super) {
  std::memcpy(super + 2 * o, block + 80, 2);  // d
  std::memcpy(super + 2 * kTileOutputs + 2 * o, block + 82, 2);  // dmin
  for (int h = 0; h < kBlockValues / 16; ++h) super[4 * kTileOutputs + kTileOutputs * h + o] = block[h];
  uint8_t levels[kGroup];
  for (int i = 0; i < kBlockValues / kGroup; ++i) {
    k_plane_block_levels(block + 16, nullptr, i, levels);
    pack_tile_levels(levels, o, super + kK2HeaderBytes + i * kK2BlockBytes, kK2Bits);
  }
}

}  // namespace

mx::array pack_k_quant_tiles(const uint8_t* blocks, int64_t num_rows, int64_t row_bytes, const std::string& kind) {
  const KQuantKind k_kind = parse_k_quant_kind(kind, "pack_k_quant_tiles");
  if (!tile_layout()) throw std::invalid_argument("pack_k_quant_tiles: K-tiles need the tile layout on");
  const int64_t block_bytes = k_quant_block_bytes(k_kind);
  constexpr int kBits[] = {kK2Bits, kK3Bits, kK4Bits, kK5Bits, kK6Bits};  // by KQuantKind
  constexpr PackSuperRow kPackers[] = {pack_q2_k_row, pack_q3_k_row, pack_q4_k_row, pack_q5_k_row, pack_q6_k_row};
  const int bits = kBits[static_cast<int>(k_kind)];
  const PackSuperRow pack_super_row = kPackers[static_cast<int>(k_kind)];
  if (num_rows <= 0 || row_bytes <= 0 || row_bytes % block_bytes != 0) {
    throw std::invalid_argument("pack_k_quant_tiles: blocks must be (rows, " + std::to_string(block_bytes) +
                                " x blocks) uint8 for " + kind + ", at least one of each");
  }
  const int64_t num_tiles = (num_rows + kTileOutputs - 1) / kTileOutputs;
  const int64_t num_bytes = quad_layout_bytes(num_rows, row_bytes / block_bytes * kBlockValues, bits);
  mx::array tiles(mx::allocator::malloc(num_bytes), {static_cast<int>(num_bytes)}, mx::uint8);
  advise_huge_pages(tiles.data<uint8_t>(), num_bytes);
  KPackJob job{blocks, tiles.data<uint8_t>(), num_rows, row_bytes, block_bytes, k_super_bytes(bits), pack_super_row};
  run_on_pool(pack_k_tile, &job, num_tiles);
  return tiles;
}

namespace {

// The triplets' shapes and types for num_rows rows of row_bytes bytes of `kind` blocks; refuses other kinds and sizes.
struct TripletShapes {
  KQuantKind kind;
  int64_t num_blocks;
  std::vector<mx::Shape> shapes;
};

TripletShapes triplet_shapes(int64_t num_rows, int64_t row_bytes, const std::string& kind_name,
                             const std::string& who) {
  const KQuantKind kind = parse_k_quant_kind(kind_name, who);
  const int64_t block_bytes = k_quant_block_bytes(kind);
  if (num_rows < 0 || row_bytes <= 0 || row_bytes % block_bytes != 0) {
    throw std::invalid_argument(who + ": blocks must be (rows, " + std::to_string(block_bytes) +
                                " x blocks) uint8 for " + kind_name);
  }
  const int64_t num_blocks = row_bytes / block_bytes, groups = num_blocks * 8;
  const int64_t words = num_blocks * (kind == KQuantKind::kQ4K ? 32 : 64);  // 4 bits, else 8
  const mx::Shape groups_shape{static_cast<int>(num_rows), static_cast<int>(groups)};
  return {kind, num_blocks, {{static_cast<int>(num_rows), static_cast<int>(words)}, groups_shape, groups_shape}};
}

const std::vector<mx::Dtype> kTripletTypes = {mx::uint32, mx::float16, mx::float16};

// Decodes num_rows rows of blocks into the three triplet arrays (allocated, not yet written).
void decode_into(const uint8_t* blocks, int64_t num_rows, int64_t num_blocks, KQuantKind kind, mx::array& weight,
                 mx::array& scales, mx::array& biases) {
  DecodeJob job{blocks, weight.data<uint8_t>(), reinterpret_cast<uint16_t*>(scales.data<mx::float16_t>()),
                reinterpret_cast<uint16_t*>(biases.data<mx::float16_t>()), num_blocks, kind,
                kernels_isa() != Isa::kPortable};
  // Fresh memory (an 8B file's 4.6 GB of triplets): on 2 MB pages it faults in 500x fewer times.
  // 8B-shaped Q4_K_M load 8.9-11.7 s with the advice, 12.2-14.1 s without (3 pairs).
  for (auto* out : {&weight, &scales, &biases}) advise_huge_pages(out->data<uint8_t>(), out->nbytes());
  run_on_pool(decode_row, &job, num_rows);
}

std::mutex g_mapped_mutex;
std::map<std::string, std::weak_ptr<const MappedFile>> g_mapped;  // path -> its mapping while any node lives

}  // namespace

struct MappedFile {
  const uint8_t* data = nullptr;
  int64_t num_bytes = 0;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  explicit MappedFile(const std::string& path) {
    const int fd = open(path.c_str(), O_RDONLY);
    struct stat info{};
    if (fd < 0 || fstat(fd, &info) != 0 || info.st_size <= 0) {
      if (fd >= 0) close(fd);
      throw std::invalid_argument("lazy_gguf_triplets: cannot read " + path);
    }
    void* mapped = mmap(nullptr, info.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);  // the mapping keeps the file
    if (mapped == MAP_FAILED) throw std::invalid_argument("lazy_gguf_triplets: cannot map " + path);
    data = static_cast<const uint8_t*>(mapped), num_bytes = info.st_size;
  }
  ~MappedFile() { munmap(const_cast<uint8_t*>(data), num_bytes); }
};

std::vector<mx::array> decode_gguf_blocks(const uint8_t* blocks, int64_t num_rows, int64_t row_bytes,
                                          const std::string& kind) {
  const TripletShapes t = triplet_shapes(num_rows, row_bytes, kind, "decode_gguf_blocks");
  std::vector<mx::array> out;
  for (int i = 0; i < 3; ++i) {
    const int64_t num_bytes = t.shapes[i][0] * static_cast<int64_t>(t.shapes[i][1]) * mx::size_of(kTripletTypes[i]);
    out.emplace_back(mx::allocator::malloc(num_bytes), t.shapes[i], kTripletTypes[i]);
  }
  decode_into(blocks, num_rows, t.num_blocks, t.kind, out[0], out[1], out[2]);
  return out;
}

std::vector<mx::array> lazy_gguf_triplets(const std::string& path, int64_t offset, int64_t num_rows, int64_t row_bytes,
                                          const std::string& kind) {
  const TripletShapes t = triplet_shapes(num_rows, row_bytes, kind, "lazy_gguf_triplets");
  std::shared_ptr<const MappedFile> file;
  {
    std::lock_guard<std::mutex> lock(g_mapped_mutex);
    for (auto it = g_mapped.begin(); it != g_mapped.end();) it = it->second.expired() ? g_mapped.erase(it) : ++it;
    file = g_mapped[path].lock();
    if (file == nullptr) g_mapped[path] = file = std::make_shared<const MappedFile>(path);
  }
  if (offset < 0 || offset + num_rows * row_bytes > file->num_bytes) {
    throw std::invalid_argument("lazy_gguf_triplets: rows past the end of " + path);
  }
  auto s = mx::default_stream(mx::Device::cpu);
  return mx::array::make_arrays(t.shapes, kTripletTypes,
                                std::make_shared<DecodeMappedBlocks>(s, file, offset, num_rows, row_bytes, t.kind),
                                {});
}

void DecodeMappedBlocks::eval_cpu(const std::vector<mx::array>&, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (auto& y : outputs) {
    y.set_data(mx::allocator::malloc(y.nbytes()));
    encoder.set_output_array(y);
  }
  encoder.dispatch([file = file_, blocks = file_->data + offset_, num_rows = num_rows_,
                    num_blocks = row_bytes_ / k_quant_block_bytes(kind_), kind = kind_,
                    weight = mx::array::unsafe_weak_copy(outputs[0]), scales = mx::array::unsafe_weak_copy(outputs[1]),
                    biases = mx::array::unsafe_weak_copy(outputs[2])]() mutable {
    decode_into(blocks, num_rows, num_blocks, kind, weight, scales, biases);
  });
}

void DecodeMappedBlocks::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("GmlxDecodeMappedBlocks runs on the CPU only");
}

bool DecodeMappedBlocks::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const DecodeMappedBlocks&>(other);
  return file_ == o.file_ && offset_ == o.offset_ && num_rows_ == o.num_rows_ && row_bytes_ == o.row_bytes_ &&
         kind_ == o.kind_;
}

}  // namespace gmlx_kernels
