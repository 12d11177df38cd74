#include "pack_layout.h"

#include <algorithm>
#include <array>
#include <cassert>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "arrays.h"
#include "encode.h"
#include "huge_pages.h"
#include "thread_pool.h"

namespace gmlx_kernels {

namespace {

constexpr int64_t kOutputsPerJob = 64;  // a pool chunk: 16 quads or 4 tiles

// What a pack reads and writes: mlx's rows as bytes (low nibble first) and float16 bits.
struct PackJob {
  const uint8_t* w;  // (num_outputs, row_bytes)
  const uint16_t* scales;  // (num_outputs, num_groups)
  const uint16_t* biases;
  uint8_t* y;
  int64_t num_outputs, num_inputs, group_size;
  int bits;  // the rows'
  int layout_bits;  // the packed layout's: bits, or 5 or kIq4Bits from 8-bit rows
  QuadLayout layout;

  int64_t row_bytes() const { return num_inputs * bits / 8; }
  // Block j's scale and bias of output n (zeros past the outputs or past K).
  uint16_t scale(int64_t n, int64_t j) const { return is_block(n, j) ? scales[group(n, j)] : 0; }
  uint16_t bias(int64_t n, int64_t j) const { return is_block(n, j) ? biases[group(n, j)] : 0; }
  bool is_block(int64_t n, int64_t j) const { return n < num_outputs && j < num_inputs / kInt8BlockInputs; }
  int64_t group(int64_t n, int64_t j) const {
    return n * (num_inputs / group_size) + j * kInt8BlockInputs / group_size;
  }
};

// Quad q's chunk of chunk_inputs inputs from first_input: the four outputs' bytes (zeros past
// K and past the outputs), then 16 scales and 16 biases, output i's block k at 4i + k.
void pack_quad_chunk(const PackJob& a, int64_t q, int64_t first_input, int64_t chunk_inputs, uint8_t* out) {
  const int64_t weight_bytes = chunk_inputs * a.bits / 8, first_byte = first_input * a.bits / 8;
  const int64_t num_bytes = std::max<int64_t>(0, std::min(weight_bytes, a.row_bytes() - first_byte));
  for (int64_t i = 0; i < kQuadOutputs; ++i) {
    const int64_t n = kQuadOutputs * q + i;
    uint8_t* dst = out + i * weight_bytes;
    const int64_t num_copied = n < a.num_outputs ? num_bytes : 0;
    if (num_copied > 0) std::memcpy(dst, a.w + n * a.row_bytes() + first_byte, num_copied);
    std::memset(dst + num_copied, 0, weight_bytes - num_copied);
  }
  auto* halves = reinterpret_cast<uint16_t*>(out + kQuadOutputs * weight_bytes);
  const int64_t num_blocks = chunk_inputs / kInt8BlockInputs, first_block = first_input / kInt8BlockInputs;
  for (int64_t i = 0; i < kQuadOutputs; ++i) {
    for (int64_t k = 0; k < 4; ++k) {
      const int64_t n = kQuadOutputs * q + i, j = first_block + k;
      halves[4 * i + k] = k < num_blocks ? a.scale(n, j) : 0;
      halves[16 + 4 * i + k] = k < num_blocks ? a.bias(n, j) : 0;
    }
  }
}

void pack_quad(const PackJob& a, int64_t q) {
  uint8_t* out = a.y + q * a.layout.quad_bytes;
  for (int64_t c = 0; c < a.layout.num_whole_chunks; ++c, out += a.layout.chunk_bytes) {
    pack_quad_chunk(a, q, c * kInt8ChunkInputs, kInt8ChunkInputs, out);
  }
  if (a.layout.has_half_chunk) {
    pack_quad_chunk(a, q, a.num_inputs - a.num_inputs % kInt8ChunkInputs, kInt8ChunkInputs / 2, out);
  }
}

// The four nibbles of `low16` one a byte, in the bytes' low nibbles (little-endian): a tile's
// byte b takes levels b and b + 4 of eight, as spread_nibbles(low) | spread_nibbles(high) << 4.
uint32_t spread_nibbles(uint32_t low16) {
  uint32_t spread = (low16 | (low16 << 8)) & 0x00FF00FFu;  // nibbles 0-1 in byte 0, 2-3 in byte 2
  return (spread | (spread << 4)) & 0x0F0F0F0Fu;
}

// Tile t: per 32-input block the 16 outputs' weights as 64-byte vectors (dword o: output o's
// four bytes; at 4 bits vector v holds inputs 8v..8v+3 in low nibbles and 8v+4..8v+7 in high
// ones, at 8 bits inputs 4v..4v+3; the narrow tiles as pack_tile_levels puts them), then 16 scales and 16 biases.
void pack_tile(const PackJob& a, int64_t t) {
  const int64_t num_blocks = a.num_inputs / kInt8BlockInputs, block_bytes = tile_block_bytes(a.layout_bits);
  const int64_t weight_bytes = block_bytes - 4 * kTileOutputs;
  uint8_t* out = a.y + t * num_blocks * block_bytes;
  for (int64_t j = 0; j < num_blocks; ++j, out += block_bytes) {
    std::memset(out, 0, block_bytes);
    auto* halves = reinterpret_cast<uint16_t*>(out + weight_bytes);
    for (int64_t o = 0; o < kTileOutputs; ++o) {
      const int64_t n = kTileOutputs * t + o;
      halves[o] = a.scale(n, j);
      halves[kTileOutputs + o] = a.bias(n, j);
      if (n >= a.num_outputs) continue;
      const uint8_t* row = a.w + n * a.row_bytes() + j * kInt8BlockInputs * a.bits / 8;
      if (a.layout_bits == kFiveBits || a.layout_bits == kIq4Bits) {
        pack_tile_levels(row, o, out, a.layout_bits);
        continue;
      }
      for (int64_t v = 0; v < weight_bytes / 64; ++v) {  // 4 vectors at 4 bits, 8 at 8
        uint32_t word;  // inputs 8v..8v+7 at 4 bits (level m in nibble m % 8), 4v..4v+3 at 8
        std::memcpy(&word, row + 4 * v, sizeof(word));
        if (a.bits == 4) word = spread_nibbles(word & 0xFFFFu) | (spread_nibbles(word >> 16) << 4);
        std::memcpy(out + v * 64 + 4 * o, &word, sizeof(word));
      }
    }
  }
}

struct PackContext {
  PackJob job;
  bool is_tiles;
};

void pack_outputs(void* context, int64_t chunk) {
  const auto& c = *static_cast<const PackContext*>(context);
  const int64_t unit = c.is_tiles ? kTileOutputs : kQuadOutputs;
  const int64_t first = chunk * (kOutputsPerJob / unit);
  const int64_t end = std::min(first + kOutputsPerJob / unit, (c.job.num_outputs + unit - 1) / unit);
  for (int64_t u = first; u < end; ++u) (c.is_tiles ? pack_tile : pack_quad)(c.job, u);
}

}  // namespace

namespace {

// pack_tile_levels for one kind of block, known at compile time (a branch a level cost the 5-bit
// pack a third more time).
template <int kBits>
void pack_levels(const uint8_t* levels, int64_t o, uint8_t* block) {
  static const auto kIndexOf = [] {
    std::array<uint8_t, 256> index_of{};
    for (int i = 0; i < 16; ++i) index_of[kIq4Levels[i]] = static_cast<uint8_t>(i);
    return index_of;
  }();
  const auto nibble = [](uint8_t level) { return kBits == kIq4Bits ? kIndexOf[level] : level & 0x0F; };
  for (int v = 0; v < 4; ++v) {
    for (int k = 0; k < 4; ++k) {
      const int low = nibble(levels[8 * v + k]), high = nibble(levels[8 * v + 4 + k]);
      block[64 * v + 4 * o + k] = static_cast<uint8_t>(low | (high << 4));
    }
  }
  uint8_t* tops = block + kTileOutputs * kInt8BlockInputs / 2;
  if constexpr (kBits == kFiveBits) {
    for (int k = 0; k < 4; ++k) {
      int fifths = 0;
      for (int v = 0; v < 8; ++v) fifths |= ((levels[4 * v + k] >> 4) & 1) << v;
      tops[4 * o + k] = static_cast<uint8_t>(fifths);
    }
  } else if constexpr (kBits == kK6Bits) {
    for (int u = 0; u < 2; ++u) {  // vectors 4u..4u + 3
      uint32_t word = 0;
      for (int k = 0; k < 4; ++k) {
        int top = 0;
        for (int m = 0; m < 4; ++m) top |= (levels[16 * u + 4 * m + k] >> 4) << (2 * m);
        word |= static_cast<uint32_t>(top) << (8 * k);
      }
      std::memcpy(tops + 64 * u + 4 * o, &word, sizeof(word));
    }
  }
}

// A K3-tile block's (no nibbles): level 4v + k's low 2 bits at bits 2 (v % 4) of byte 64 (v / 4) + 4o + k,
// its third bit at bit v of byte 128 + 4o + k (a K2-tile block: the 2 bits alone).
template <bool kHasThirds>
void pack_plane_levels(const uint8_t* levels, int64_t o, uint8_t* block) {
  uint32_t planes[2] = {0, 0}, thirds = 0;  // bytes k = 0..3 at once: no level's bits leave its byte
  for (int v = 0; v < 8; ++v) {
    uint32_t word;  // levels 4v..4v+3
    std::memcpy(&word, levels + 4 * v, sizeof(word));
    planes[v / 4] |= (word & 0x03030303u) << (2 * (v % 4));
    thirds |= ((word >> 2) & 0x01010101u) << v;
  }
  std::memcpy(block + 4 * o, &planes[0], sizeof(uint32_t));
  std::memcpy(block + 64 + 4 * o, &planes[1], sizeof(uint32_t));
  if constexpr (kHasThirds) std::memcpy(block + 128 + 4 * o, &thirds, sizeof(uint32_t));
}

}  // namespace

void pack_tile_levels(const uint8_t* levels, int64_t o, uint8_t* block, int bits) {
  switch (bits) {
    case kK2Bits: return pack_plane_levels<false>(levels, o, block);
    case kK3Bits: return pack_plane_levels<true>(levels, o, block);
    case 4: return pack_levels<4>(levels, o, block);
    case kFiveBits: return pack_levels<kFiveBits>(levels, o, block);
    case kIq4Bits: return pack_levels<kIq4Bits>(levels, o, block);
    default: assert(bits == kK6Bits); return pack_levels<kK6Bits>(levels, o, block);
  }
}

mx::array pack_quads(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits,
                     int layout_bits) {
  if (bits != 4 && bits != 8) throw std::invalid_argument("bits " + std::to_string(bits) + ": expected 4 or 8");
  if (layout_bits == 0) layout_bits = bits;
  const bool is_narrow = layout_bits == kFiveBits || layout_bits == kIq4Bits;
  if (layout_bits != bits && (!is_narrow || bits != 8 || !tile_layout())) {
    throw std::invalid_argument("pack_quads: layout_bits " + std::to_string(layout_bits) + ": expected the rows' " +
                                "bits, or 5 or " + std::to_string(kIq4Bits) + " from 8-bit rows under the tile layout");
  }
  if (w.dtype() != mx::uint32 || w.ndim() != 2) throw std::invalid_argument("pack_quads: w must be 2-D uint32");
  const int64_t num_outputs = w.shape(0), num_inputs = static_cast<int64_t>(w.shape(1)) * 32 / bits;
  if (group_size <= 0 || group_size % kInt8BlockInputs != 0 || num_inputs % group_size != 0) {
    throw std::invalid_argument("pack_quads: group_size " + std::to_string(group_size) +
                                " must be a multiple of 32 dividing the inputs (" + std::to_string(num_inputs) + ")");
  }
  const mx::Shape groups_shape{static_cast<int>(num_outputs), static_cast<int>(num_inputs / group_size)};
  for (const auto* values : {&scales, &biases}) {
    if (values->dtype() != mx::float16 || values->shape() != groups_shape) {
      throw std::invalid_argument(
          "pack_quads: scales and biases must be float16 of shape (outputs, inputs / group_size)");
    }
  }
  auto s = mx::default_stream(mx::Device::cpu);
  const int size = static_cast<int>(quad_layout_bytes(num_outputs, num_inputs, layout_bits));
  return mx::array(
      {size}, mx::uint8,
      std::make_shared<PackQuads>(s, group_size, bits, layout_bits, tile_layout(), quad_layout(num_inputs, bits)),
      {w, scales, biases});
}

void PackQuads::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  EncodedArrays arrays = encode_arrays(encoder, inputs, outputs);  // the bytes' buffer, typed float*
  encoder.dispatch([in = std::move(arrays.inputs), y = reinterpret_cast<uint8_t*>(arrays.outputs[0]),
                    group_size = group_size_, bits = bits_, layout_bits = layout_bits_, is_tiles = is_tiles_,
                    layout = layout_,
                    num_bytes = static_cast<int64_t>(outputs[0].nbytes())]() {
    std::vector<uint32_t> w_copy;
    std::vector<uint16_t> scales_copy, biases_copy;
    PackContext context{};
    context.is_tiles = is_tiles;
    PackJob& job = context.job;
    job.w = reinterpret_cast<const uint8_t*>(row_major_data<uint32_t>(in[0], w_copy));
    job.scales = row_major_data<uint16_t>(in[1], scales_copy);
    job.biases = row_major_data<uint16_t>(in[2], biases_copy);
    job.y = y;
    job.num_outputs = in[0].shape(0);
    job.num_inputs = static_cast<int64_t>(in[0].shape(1)) * 32 / bits;
    job.group_size = group_size;
    job.bits = bits;
    job.layout_bits = layout_bits;
    job.layout = layout;
    // Before the first write, so the weights fault in huge: moving them there after (memory.py)
    // copied 0.6 GB a second at load.
    advise_huge_pages(y, num_bytes);
    run_on_pool(pack_outputs, &context, (job.num_outputs + kOutputsPerJob - 1) / kOutputsPerJob);
  });
}

void PackQuads::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("GmlxPackQuads runs on the CPU only");
}

bool PackQuads::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const PackQuads&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && layout_bits_ == o.layout_bits_ &&
         is_tiles_ == o.is_tiles_ && layout_.quad_bytes == o.layout_.quad_bytes &&
         layout_.has_half_chunk == o.layout_.has_half_chunk;
}

}  // namespace gmlx_kernels
