#include "int8_many_rows.h"

#include <algorithm>
#include <atomic>
#include <cassert>
#include <vector>

#include "isa_target.h"

namespace gmlx_kernels {

namespace {

// Measured on Zen 3 against the quad kernels' four-row walks (SmolLM2's shapes, two threads):
// level at 16 rows, 1.05-1.28x from 32, 1.10-1.23x at a prefill chunk's 256.
constexpr int64_t kDefaultManyRowsMin = 32;
std::atomic<int64_t> g_many_rows_min{kDefaultManyRowsMin};

}  // namespace

int64_t many_rows_min() { return g_many_rows_min.load(std::memory_order_relaxed); }
void set_many_rows_min(int64_t num_rows) { g_many_rows_min.store(num_rows < 1 ? kDefaultManyRowsMin : num_rows); }

#if GMLX_X86

namespace {

constexpr int kPanelOutputs = 8;  // two quads, one output per dword lane
constexpr int kBlocksPerChunk = 4;
constexpr int kStepsPerBlock = 8;  // four of a block's 32 inputs a step
constexpr int64_t kRowsPerGroup = 16;  // 16 rows of x at K = 1536: 24 KB, within L1
// Panels unpacked at once: a range's panels up to this many bytes stay in L2 while every row
// group passes over them (SmolLM2's ranges: 150 KB for 80 outputs at K = 1536, two batches
// for gate and up's 384 at K = 576).
constexpr int64_t kPanelBatchBytes = 256 << 10;

// One 32-input block k of eight outputs. x stores a chunk's block k for 4-bit weights at 16k
// (its 16 even inputs) and 64 + 16k (its 16 odd ones); step u's vector holds in dword o output
// o's four weights that meet x's bytes 16k + 4u (u < 4) or 64 + 16k + 4(u - 4). Then the
// outputs' scales and biases as floats.
struct alignas(32) PanelBlock {
  __m256i w[kStepsPerBlock];
  float s[kPanelOutputs];
  float b[kPanelOutputs];
};

// Eight vectors of eight dwords transposed: out[k]'s dword o is in[o]'s dword k.
GMLX_AVX2_F16C inline void transpose8x8(const __m256i* in, __m256i* out) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(in[i], in[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(in[i], in[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    out[k] = _mm256_permute2x128_si256(u[k], u[k + 4], 0x20);
    out[k + 4] = _mm256_permute2x128_si256(u[k], u[k + 4], 0x31);
  }
}

// One chunk (whole: 4 blocks, half: blocks 0-1) of two quads into the panel's blocks. A quad's
// byte i of an output's chunk holds the input x stores at byte i in its low nibble and the one
// at 64 + i in its high nibble (int8_dot_kernels.h).
GMLX_AVX2_F16C void unpack_chunk(const uint8_t* quad_a, const uint8_t* quad_b, bool is_half, PanelBlock* out) {
  const int64_t weight_bytes = kInt8ChunkInputs / 2 / (is_half ? 2 : 1);
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int64_t part = 0; part < weight_bytes / 32; ++part) {  // dwords 8 part .. 8 part + 7 of each output
    __m256i rows[kPanelOutputs], dwords[kPanelOutputs];
    for (int o = 0; o < kQuadOutputs; ++o) {
      rows[o] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quad_a + o * weight_bytes + 32 * part));
      rows[kQuadOutputs + o] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quad_b + o * weight_bytes + 32 * part));
    }
    transpose8x8(rows, dwords);
    for (int i = 0; i < 8; ++i) {
      // x's even bytes 4 dword.. (block dword / 4), odd ones 64 + 4 dword..
      const int dword = static_cast<int>(8 * part) + i;
      PanelBlock& block = out[dword / 4];
      block.w[dword % 4] = _mm256_and_si256(dwords[i], nibble);
      block.w[4 + dword % 4] = _mm256_and_si256(_mm256_srli_epi16(dwords[i], 4), nibble);
    }
  }
  // Each quad's 16 scales, then 16 biases, as halves at 4i + k (output i, block k).
  const int num_blocks = is_half ? 2 : kBlocksPerChunk;
  const uint8_t* quads[2] = {quad_a, quad_b};
  for (int q = 0; q < 2; ++q) {
    const auto* halves = reinterpret_cast<const __m128i*>(quads[q] + kQuadOutputs * weight_bytes);
    alignas(32) float values[2][16];
    for (int v = 0; v < 2; ++v) {  // scales, biases
      _mm256_store_ps(values[v], _mm256_cvtph_ps(_mm_loadu_si128(halves + 2 * v)));
      _mm256_store_ps(values[v] + 8, _mm256_cvtph_ps(_mm_loadu_si128(halves + 2 * v + 1)));
    }
    for (int k = 0; k < num_blocks; ++k) {
      for (int i = 0; i < kQuadOutputs; ++i) {
        out[k].s[kQuadOutputs * q + i] = values[0][4 * i + k];
        out[k].b[kQuadOutputs * q + i] = values[1][4 * i + k];
      }
    }
  }
}

// One block's integer sums of row xq's chunk bytes: x's 16 even and 16 odd bytes of the block
// loaded once into both 128-bit lanes, each step's four spread within them by a shuffle. A
// step's pairs are at most 2 * 15 * 127, so eight steps sum in int16; then one madd to int32.
template <int kBlock>
GMLX_AVX2_F16C inline __attribute__((always_inline)) __m256i block_sums(const PanelBlock& block, const int8_t* xq) {
  const __m256i evens = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + 16 * kBlock)));
  const __m256i odds = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + 64 + 16 * kBlock)));
  const __m256i steps[kStepsPerBlock] = {
      _mm256_shuffle_epi32(evens, 0x00), _mm256_shuffle_epi32(evens, 0x55), _mm256_shuffle_epi32(evens, 0xAA),
      _mm256_shuffle_epi32(evens, 0xFF), _mm256_shuffle_epi32(odds, 0x00),  _mm256_shuffle_epi32(odds, 0x55),
      _mm256_shuffle_epi32(odds, 0xAA),  _mm256_shuffle_epi32(odds, 0xFF)};
  __m256i s0 = _mm256_maddubs_epi16(_mm256_load_si256(block.w + 0), steps[0]);
  __m256i s1 = _mm256_maddubs_epi16(_mm256_load_si256(block.w + 1), steps[1]);
  for (int u = 2; u < kStepsPerBlock; u += 2) {
    s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(_mm256_load_si256(block.w + u), steps[u]));
    s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(_mm256_load_si256(block.w + u + 1), steps[u + 1]));
  }
  return _mm256_madd_epi16(_mm256_add_epi16(s0, s1), _mm256_set1_epi16(1));
}

// The float steps of a block on its lane: fma(s, d * isum, lane), then fma(b, xsd, lane).
GMLX_AVX2_F16C inline __attribute__((always_inline)) __m256 plus_block(__m256 lane, const PanelBlock& block,
                                                                      __m256i isum, float d, float xsd) {
  lane = _mm256_fmadd_ps(_mm256_load_ps(block.s), _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(isum)), lane);
  return _mm256_fmadd_ps(_mm256_load_ps(block.b), _mm256_set1_ps(xsd), lane);
}

// Row r over a panel: its lanes chunk by chunk (a chunk's integer sums first, then their float
// steps), then (l0 + l1) + (l2 + l3) into y's first num_valid outputs.
GMLX_AVX2_F16C void panel_row(const PanelBlock* panel, const QmmArgs& a, const QuantizedRows& x, int64_t r,
                              int64_t n0, int num_valid, const QuadLayout& layout) {
  const int8_t* xq = x.q_row(r);
  const float* d = x.d_row(r);
  const float* xsd = x.xsd_row(r);
  __m256 l0 = _mm256_setzero_ps(), l1 = _mm256_setzero_ps(), l2 = _mm256_setzero_ps(), l3 = _mm256_setzero_ps();
  const PanelBlock* block = panel;
  for (int64_t c = 0; c < layout.num_whole_chunks; ++c, block += kBlocksPerChunk, xq += kInt8ChunkInputs) {
    const __m256i i0 = block_sums<0>(block[0], xq), i1 = block_sums<1>(block[1], xq);
    const __m256i i2 = block_sums<2>(block[2], xq), i3 = block_sums<3>(block[3], xq);
    const int64_t j = c * kBlocksPerChunk;
    l0 = plus_block(l0, block[0], i0, d[j], xsd[j]);
    l1 = plus_block(l1, block[1], i1, d[j + 1], xsd[j + 1]);
    l2 = plus_block(l2, block[2], i2, d[j + 2], xsd[j + 2]);
    l3 = plus_block(l3, block[3], i3, d[j + 3], xsd[j + 3]);
  }
  if (layout.has_half_chunk) {  // blocks 0-1 only
    const __m256i i0 = block_sums<0>(block[0], xq), i1 = block_sums<1>(block[1], xq);
    const int64_t j = layout.num_whole_chunks * kBlocksPerChunk;
    l0 = plus_block(l0, block[0], i0, d[j], xsd[j]);
    l1 = plus_block(l1, block[1], i1, d[j + 1], xsd[j + 1]);
  }
  const __m256 out = _mm256_add_ps(_mm256_add_ps(l0, l1), _mm256_add_ps(l2, l3));
  float* y = a.y + r * a.num_outputs + n0;
  if (num_valid == kPanelOutputs) {
    _mm256_storeu_ps(y, out);
  } else {
    alignas(32) float values[kPanelOutputs];
    _mm256_store_ps(values, out);
    for (int i = 0; i < num_valid; ++i) y[i] = values[i];
  }
}

// Tiles [first, first + num) of the range from n0 = begin unpacked into panels (num_blocks each).
GMLX_AVX2_F16C void unpack_tiles(const QmmArgs& a, const QuadLayout& layout, int64_t begin, int64_t end, int64_t first,
                                 int64_t num, int64_t num_blocks, PanelBlock* panels) {
  for (int64_t t = 0; t < num; ++t) {
    const int64_t n0 = begin + (first + t) * kPanelOutputs;
    const uint8_t* quad_a = a.quads + n0 / kQuadOutputs * layout.quad_bytes;
    const uint8_t* quad_b = end - n0 > kQuadOutputs ? quad_a + layout.quad_bytes : quad_a;  // else dropped
    PanelBlock* panel = panels + t * num_blocks;
    for (int64_t c = 0; c < layout.num_whole_chunks; ++c) {
      unpack_chunk(quad_a + c * layout.chunk_bytes, quad_b + c * layout.chunk_bytes, false,
                   panel + c * kBlocksPerChunk);
    }
    if (layout.has_half_chunk) {
      const int64_t at = layout.num_whole_chunks * layout.chunk_bytes;
      unpack_chunk(quad_a + at, quad_b + at, true, panel + layout.num_whole_chunks * kBlocksPerChunk);
    }
  }
}

}  // namespace

// The range's tiles in batches whose panels stay in L2; for each batch the rows in groups whose
// x stays in L1 while they pass over its panels: x read once from L2 per group and batch.
GMLX_AVX2_F16C void quads4_many_rows_avx2(const QmmArgs& a, const QuantizedRows& x, int64_t begin, int64_t end) {
  assert(a.bits == 4 && a.quads != nullptr && begin % kQuadOutputs == 0);
  const QuadLayout layout = quad_layout(a.num_inputs, 4);
  const int64_t num_blocks = layout.num_whole_chunks * kBlocksPerChunk + (layout.has_half_chunk ? 2 : 0);
  const int64_t num_tiles = (end - begin + kPanelOutputs - 1) / kPanelOutputs;
  const int64_t panel_bytes = num_blocks * static_cast<int64_t>(sizeof(PanelBlock));
  const int64_t tiles_per_batch = std::max<int64_t>(1, kPanelBatchBytes / panel_bytes);
  thread_local std::vector<PanelBlock> panels;  // this thread's, reused across calls
  panels.resize(std::min(num_tiles, tiles_per_batch) * num_blocks);
  for (int64_t first = 0; first < num_tiles; first += tiles_per_batch) {
    const int64_t num = std::min(tiles_per_batch, num_tiles - first);
    unpack_tiles(a, layout, begin, end, first, num, num_blocks, panels.data());
    for (int64_t r0 = 0; r0 < a.num_rows; r0 += kRowsPerGroup) {
      const int64_t r1 = std::min(r0 + kRowsPerGroup, a.num_rows);
      for (int64_t t = 0; t < num; ++t) {
        const int64_t n0 = begin + (first + t) * kPanelOutputs;
        const int num_valid = static_cast<int>(std::min<int64_t>(kPanelOutputs, end - n0));
        for (int64_t r = r0; r < r1; ++r) panel_row(panels.data() + t * num_blocks, a, x, r, n0, num_valid, layout);
      }
    }
  }
}

#endif  // x86 only: int8_dot_outputs calls it from its x86 branch

}  // namespace gmlx_kernels
