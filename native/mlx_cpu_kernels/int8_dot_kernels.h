// 4- and 8-bit affine weights against int8-quantized activations (GMLX_CPU_QUANT_ACTIVATIONS=int8).
//
// Each row of x is quantized once per call, per block of 32 inputs: d = amax / 127,
// q = round-half-even(x * (127 / amax)) (0 when amax is 0), and xsd = d * sum(q). A weight
// w = s * qw + b then contributes, per block j of group g:
//   p = d_j * float(sum_i qw_i * q_i)        the integer dot is exact in any order
//   lane[j % 4] = fma(s_g, p, lane[j % 4]);  lane[j % 4] = fma(b_g, xsd_j, lane[j % 4])
// and the output is (lane0 + lane1) + (lane2 + lane3). Blocks past K (K padded to a
// multiple of 128) run the same two fmas with zeros. Every ISA computes exactly these
// float operations per output, so a row's bits never depend on the ISA, the row count
// or the thread count.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "qmm_kernels.h"

namespace gmlx_kernels {

constexpr int64_t kInt8BlockInputs = 32;
constexpr int64_t kInt8ChunkInputs = 128;  // four blocks: one zmm of packed 4-bit weights
constexpr int kQuadOutputs = 4;  // outputs a quad interleaves; their lanes fill one zmm

// x quantized per row. Per row, q holds padded_inputs bytes: for 4-bit weights, for each
// 128-input chunk the 64 even-position values of its four blocks (16 each), then the 64 odd
// ones, to match a byte's low (even) and high (odd) nibble; for 8-bit weights x's own order.
// d and xsd hold one float per block.
struct QuantizedRows {
  int64_t num_rows = 0;
  int64_t padded_inputs = 0;
  std::vector<int8_t> q;  // (num_rows, padded_inputs)
  std::vector<float> d;  // (num_rows, padded_inputs / 32)
  std::vector<float> xsd;  // (num_rows, padded_inputs / 32)
  std::vector<int32_t> half_sums;  // (num_rows, 2 * padded_inputs / 32): sum(q) of each block's halves (K6-tiles)
  std::vector<float> half_xsd;  // (num_rows, 2 * padded_inputs / 32): d * float(half sum) (K2-tiles)
  const int8_t* q_row(int64_t r) const { return q.data() + r * padded_inputs; }
  const int32_t* half_sums_row(int64_t r) const { return half_sums.data() + r * 2 * padded_inputs / kInt8BlockInputs; }
  const float* d_row(int64_t r) const { return d.data() + r * (padded_inputs / kInt8BlockInputs); }
  const float* xsd_row(int64_t r) const { return xsd.data() + r * (padded_inputs / kInt8BlockInputs); }
  const float* half_xsd_row(int64_t r) const { return half_xsd.data() + r * 2 * padded_inputs / kInt8BlockInputs; }
};

// Sizes `rows` for x (num_rows, num_inputs).
void resize_quantized_rows(QuantizedRows& rows, int64_t num_rows, int64_t num_inputs);
// Quantizes rows [begin, end) of x (row-major, num_inputs wide) into `rows`, laid out for
// weights of `bits` (4 or 8).
void quantize_rows(const float* x, int64_t num_inputs, int64_t begin, int64_t end, int bits, QuantizedRows& rows);

// Outputs [begin, end) of every row, for 4- or 8-bit weights (args.x unused). An 8-bit
// weight's byte is split into nibbles on AVX2 (maddubs's int16 pairs) and taken whole by VNNI.
void int8_dot_outputs(const QmmArgs& args, const QuantizedRows& rows, int64_t begin, int64_t end, Isa isa);

// IEEE half to float, exact (subnormals included), for the portable path and scalar reads.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  uint32_t bits = sign;
  if (exponent == 0x1F) {
    bits |= 0x7F800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits |= ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa != 0) {  // subnormal: mantissa * 2^-24, normalized
    uint32_t m = mantissa, shifts = 0;
    while ((m & 0x400u) == 0) m <<= 1, ++shifts;
    bits |= ((113 - shifts) << 23) | ((m & 0x3FFu) << 13);
  }
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

bool has_avx512_vnni();
// GFNI (Ice Lake, Zen 4 on): K5- and K6-tiles move each vector's top bits into place with one
// affine byte op instead of a shift and an and (a 14336x4096 product: Q5_K at 1 and 3 rows 1.15x,
// Q6_K at 3 rows 1.13x). Same integers, so the same bits. set_gfni: 0 off, 1 on where has_gfni(),
// -1 the default (on where it is).
bool has_gfni();
void set_gfni(int setting);
int gfni_setting();
bool is_gfni_enabled();
// F16C, which the AVX2 int8 kernels convert their float16 scales with (every AVX2 CPU has it).
bool has_f16c();

// The quad-interleaved layout: the weights read as one stream, in the order the kernels read
// them. For each four outputs (zero rows past the last), for each 128-input chunk (zeros past
// K): the four outputs' packed weights of the chunk (64 bytes each at 4 bits, 128 at 8), then
// 16 float16 scales and 16 float16 biases, value 4i + k for output i's block k (a group's
// value once per block of 32). The same floats as the plain rows, so the same bits.
// With half tails, a K whose last chunk holds at most 64 inputs (K = 576: 4.5 chunks) ends
// each quad in a half chunk: the four outputs' weights of its two blocks (32 bytes each at 4
// bits, 64 at 8), then the 16 scales and 16 biases (zeros for blocks 2-3): 10% fewer bytes
// at K = 576, and the same bits (a block past K adds fma(0, 0, lane), which keeps the lane).
int64_t quad_chunk_bytes(int bits);
// The layout's shape for K inputs: whole chunks, then a half chunk or not.
struct QuadLayout {
  int64_t num_whole_chunks = 0;  // 128-input chunks, the last one padded where K needs it
  bool has_half_chunk = false;
  int64_t chunk_bytes = 0;
  int64_t half_chunk_bytes = 0;
  int64_t quad_bytes = 0;  // one quad's stream
};
QuadLayout quad_layout(int64_t num_inputs, int bits);
// Whether layouts packed from now on end in half chunks (the default). A knob for tests and
// benchmarks, which pack after setting it.
void set_half_tails(bool is_enabled);
bool half_tails();
// The one-stream layout's bytes: tiles or quads, as tile_layout() says.
int64_t quad_layout_bytes(int64_t num_outputs, int64_t num_inputs, int bits);
// The tile layout, the one-stream layout on VNNI CPUs: for each 16 outputs (zero rows past
// the last), for each 32-input block: the 16 outputs' weights, then their 16 float16 scales
// and 16 biases (output o at o; a group's value once per block). The weights of a block are
// 64-byte vectors, dword o of each one output's four bytes: at 4 bits vector t holds inputs
// 8t..8t+3 in low nibbles and 8t+4..8t+7 in high ones, at 8 bits vector t inputs 4t..4t+3.
// A vpdpbusd against four of x's bytes broadcast so gives each output's block sum in its own
// lane, with no reduction across lanes: a row costs 8 integer dots and 4 float operations a block. Same
// floats per output as the quad layout (block j's two fmas on lane j % 4), so the same bits.
constexpr int64_t kTileOutputs = 16;
// The IQ4 tiles (bits kIq4Bits, VNNI CPUs): 8-bit rows whose levels all are IQ4's 16 codebook values
// plus 128 (a GGUF's IQ4_NL and IQ4_XS, read exactly at 8 bits) as a 4-bit tile's blocks of their
// codebook indices, each vector's indices looked up (vpshufb) into the levels before its dots:
// 0.625 bytes a weight against 1.125, the same integers and float steps as the 8-bit tiles, so the
// same bits. Packed from 8-bit rows by pack_quads with layout_bits kIq4Bits, under the tile layout.
constexpr int kIq4Bits = 263;
// The 16 levels an IQ4 index picks: llama.cpp's non-linear grid [-127, 113] plus 128.
constexpr uint8_t kIq4Levels[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
// A tile block's weight bytes and whole bytes (weights, then 16 float16 scales and 16 biases).
constexpr int64_t tile_weight_bytes(int bits) {
  return kTileOutputs * kInt8BlockInputs * (bits == kIq4Bits ? 4 : bits) / 8;
}
constexpr int64_t tile_block_bytes(int bits) { return tile_weight_bytes(bits) + 2 * kTileOutputs * 2; }
// The 5-bit tiles (bits 5, VNNI CPUs): 8-bit rows whose levels all fit 5 bits (a GGUF's Q5_0 and
// Q5_1, read exactly at 8 bits) as a 4-bit tile block's weight vectors of their low 4 bits, then 64
// bytes of fifth bits (vector i's at bit i, as a K5-tile block), then the 16 scales and 16 biases:
// 0.75 bytes a weight against 1.125. The same integer block sums and float steps as the 8-bit tiles,
// so the same bits. Packed from 8-bit rows by pack_quads with layout_bits 5, under the tile layout.
constexpr int kFiveBits = 5;
// The K-tile layout (bits kK4Bits), a GGUF Q4_K matrix's in the tile layout: where a 4-bit tile
// keeps each block's 16 float16 scales and biases (64 bytes), a K-tile keeps Q4_K's own: per
// 256-input super-block, the 16 outputs' float16 d and dmin and each block's 6-bit scale and min
// as bytes (320 bytes), then the eight blocks' weights as a 4-bit tile's. 0.578 bytes a weight
// against 0.625. Block j's scale is d * sc and its bias -dmin * m, exact in float32, so each
// block runs a 4-bit tile's float steps on those: where both are float16 values the bits are a
// 4-bit tile's. Packed from a GGUF's Q4_K blocks (pack_k_quant_tiles), under the tile layout only.
constexpr int kK4Bits = 260;  // a layout tag beside 4 and 8: K-quant super-blocks of 256, 4 bits
constexpr int64_t kSuperBlockInputs = 256;
constexpr int64_t kK4HeaderBytes = 2 * kTileOutputs * 2 + 2 * kTileOutputs * (kSuperBlockInputs / kInt8BlockInputs);
constexpr int64_t kK4SuperBytes = kK4HeaderBytes + kTileOutputs * kSuperBlockInputs / 2;
// The K5-tile layout (bits kK5Bits), a GGUF Q5_K matrix's (Q4_K's super-blocks with 5-bit levels):
// a K-tile's super-block with 64 more bytes after each block's weight vectors holding the levels'
// fifth bits (vector i's at bit i of those bytes). 0.70 bytes a weight, where Q5_K at 8 bits took
// 1.125; exact. A block's levels merge their fifth bit in, then run the K-tiles' float steps.
constexpr int kK5Bits = 261;  // super-blocks of 256, 5 bits
constexpr int64_t kK5BlockBytes = kTileOutputs * kInt8BlockInputs * 5 / 8;
constexpr int64_t kK5SuperBytes = kK4HeaderBytes + kSuperBlockInputs / kInt8BlockInputs * kK5BlockBytes;
// The K6-tile layout (bits kK6Bits), a GGUF Q6_K matrix's (each weight d * sc * (q - 32), q of 6
// bits, an int8 sc per 16 inputs): per 256-input super-block the 16 outputs' float16 d, then their
// 16 sub-block scales (sub-block major), 288 bytes; then per 32-input block a 4-bit tile block's
// weight vectors holding q's low 4 bits and 128 bytes of its top 2 (vector i's at bits 2 (i % 4) of
// the 64 bytes i / 4). 0.82 bytes a weight, where Q6_K requantized to 8 bits took 1.125. Each
// block's two sub-blocks sum apart, A and B = sum(q x) - 32 sum(x), then with s = d * sc (exact):
// t = fma(s_a, float(A), s_b * float(B)) and fma(d_j, t, lane). Exact Q6_K values. Packed from a
// GGUF's Q6_K blocks (pack_k_quant_tiles).
constexpr int kK6Bits = 262;  // super-blocks of 256, 6 bits
constexpr int64_t kSubBlockInputs = 16;
constexpr int64_t kK6HeaderBytes = 2 * kTileOutputs + kTileOutputs * (kSuperBlockInputs / kSubBlockInputs);
constexpr int64_t kK6BlockBytes = kTileOutputs * kInt8BlockInputs * 6 / 8;
constexpr int64_t kK6SuperBytes = kK6HeaderBytes + kSuperBlockInputs / kInt8BlockInputs * kK6BlockBytes;
// The K3-tile layout (bits kK3Bits), a GGUF Q3_K matrix's (each weight d * sc * (q - 4), q of 3 bits,
// an sc of 6 bits less 32 per 16 inputs): a K6-tile's super-block header (d, the int8 sub-block
// scales), then per 32-input block 128 bytes of q's low 2 bits (vector i's at bits 2 (i % 4) of the
// 64 bytes i / 4, so each 64 bytes hold one sub-block) and 64 of its third bits (vector i's at bit i).
// 0.45 bytes a weight, where Q3_K requantized to 8 bits took 1.125. A K6-tile's steps with the
// sub-blocks' sums less 4 sum(x): exact Q3_K values. Packed from a GGUF's Q3_K blocks (pack_k_quant_tiles).
constexpr int kK3Bits = 259;  // super-blocks of 256, 3 bits
constexpr int64_t kK3BlockBytes = kTileOutputs * kInt8BlockInputs * 3 / 8;
constexpr int64_t kK3SuperBytes = kK6HeaderBytes + kSuperBlockInputs / kInt8BlockInputs * kK3BlockBytes;
// The K2-tile layout (bits kK2Bits), a GGUF Q2_K matrix's (each weight d * sc * q - dmin * m, q of 2
// bits, a 4-bit sc and m per 16 inputs): per 256-input super-block the 16 outputs' float16 d and dmin,
// then each sub-block's sc | m << 4 byte (sub-block major; 320 bytes), then per 32-input block a K3-tile
// block's 128 bytes of 2-bit levels (no third bits). 0.33 bytes a weight, where Q2_K requantized to 8
// bits took 1.125. Each block's sub-blocks sum apart (A, B), then with s = d * sc and b = -dmin * m
// (exact): t = fma(s_a, float(A), s_b * float(B)), fma(d_j, t, lane), then fma(b_a, x's d_j * float(half
// sum a), lane) and the same for b. Exact Q2_K values. Packed from a GGUF's Q2_K blocks (pack_k_quant_tiles).
constexpr int kK2Bits = 258;  // super-blocks of 256, 2 bits
constexpr int64_t kK2HeaderBytes = 2 * kTileOutputs * 2 + kTileOutputs * (kSuperBlockInputs / kSubBlockInputs);
constexpr int64_t kK2BlockBytes = kTileOutputs * kInt8BlockInputs * 2 / 8;
constexpr int64_t kK2SuperBytes = kK2HeaderBytes + kSuperBlockInputs / kInt8BlockInputs * kK2BlockBytes;
// Whether bits name one of the K layouts, and a super-block's bytes in it (tiles of 16 outputs).
constexpr bool is_k_layout(int bits) {
  return bits == kK2Bits || bits == kK3Bits || bits == kK4Bits || bits == kK5Bits || bits == kK6Bits;
}
constexpr int64_t k_super_bytes(int bits) {
  return bits == kK2Bits   ? kK2SuperBytes
         : bits == kK3Bits ? kK3SuperBytes
         : bits == kK4Bits ? kK4SuperBytes
         : bits == kK5Bits ? kK5SuperBytes
                           : kK6SuperBytes;
}
// Bits naming a weight layout the int8 path runs: 4, 8, and the 5-bit and IQ4 tiles and the K layouts
// (kK2Bits to kK6Bits) under the tile layout.
bool is_layout_bits(int bits);
// std::invalid_argument naming `bits` where is_layout_bits is false.
void check_layout_bits(int bits);
// Whether layouts packed from now on are tiles (default: where the CPU has VNNI) or quads.
// Kernels and lookups read a layout under the setting it was packed under.
void set_tile_layout(bool is_enabled);
// AMX for the tiles' groups of 8-16 rows (a wide batch's products; same bits: the same integer
// block sums, the same float steps): where the CPU has AMX-INT8 and the OS grants its state
// (has_amx), on by default. set_amx: 0 off, 1 on where has_amx(), -1 the default.
bool has_amx();
void set_amx(int setting);
int amx_setting();
bool is_amx_enabled();
bool tile_layout();
// Outputs [begin, end) (begin a multiple of 16) of every row over the tile layout; x
// quantized in x's own order (quantize_rows with bits 8), whatever the weights' bits.
void tile_outputs(const QmmArgs& args, const QuantizedRows& rows, int64_t begin, int64_t end, Isa isa);
// Row `id` of a tile layout, dequantized into y (num_inputs floats).
void tile_row(const uint8_t* tiles, int64_t id, int64_t num_inputs, int bits, float* y);
// Steps ahead the one-stream kernels prefetch (quads: chunks, tiles: blocks; 0: off; -1:
// each layout's default: 8 chunks for quads; for tiles 8 blocks on Intel, none elsewhere). Same bits.
void set_prefetch_chunks(int64_t num_chunks);
int64_t prefetch_chunks();
// Blocks ahead the tile kernels prefetch now: the setting, or where unset this CPU's default.
int64_t tile_prefetch_blocks();

}  // namespace gmlx_kernels
