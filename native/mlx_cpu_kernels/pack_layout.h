// mlx's affine rows (4- or 8-bit weights, float16 scales and biases) packed into the one-stream
// layout the int8 kernels read (int8_dot_kernels.h: tiles on VNNI CPUs, else quads), as one MLX
// primitive. A byte shuffle, threaded over tiles or quads: at load it replaces ~20 mlx copies a
// matrix (3.2 s of a 1B model's 18 s load).
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "int8_dot_kernels.h"

namespace gmlx_kernels {

namespace mx = mlx::core;

// (quad_layout_bytes(N, K, bits),) uint8 from w (N, K * bits / 32) uint32, scales and biases
// (N, K / group_size) float16. The layout (tiles or quads, half tails or not) is the one set
// when this is called, whenever the node is evaluated. layout_bits (0: bits) 5 packs 8-bit rows
// whose levels all fit 5 bits as the 5-bit tiles, kIq4Bits those whose levels are all kIq4Levels as
// the IQ4 tiles (tile layout only; other levels are not kept, so the caller checks them).
mx::array pack_quads(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits,
                     int layout_bits = 0);

// Output o's 32 levels of a 32-input block (a byte each) into its place in a tile block whose weights
// are `bits`: 4 (a 4-bit tile's, or a K-tile's: the nibbles), kFiveBits (a 5-bit or K5-tile's: the
// nibbles, then bit 4 of level 4v + k at bit v of byte 4o + k of the next 64 bytes), kIq4Bits (the
// levels' indices in kIq4Levels as nibbles; 0 for a level not there) or kK6Bits (a K6-tile block's:
// the nibbles, then the top 2 bits of level 4v + k at bits 2 (v % 4) of byte 64 (v / 4) + 4o + k of
// the next 128 bytes), kK3Bits (a K3-tile block's: no nibbles; the low 2 bits of level 4v + k at bits
// 2 (v % 4) of byte 64 (v / 4) + 4o + k, its third bit at bit v of byte 128 + 4o + k) or kK2Bits (a
// K2-tile block's: those 2 bits alone). Nibbles: vector v's
// dword o holds levels 8v..8v+3 low, 8v+4..8v+7 high.
void pack_tile_levels(const uint8_t* levels, int64_t o, uint8_t* block, int bits);

class PackQuads : public mx::Primitive {
 public:
  PackQuads(mx::Stream stream, int group_size, int bits, int layout_bits, bool is_tiles, QuadLayout layout)
      : mx::Primitive(stream),
        group_size_(group_size),
        bits_(bits),
        layout_bits_(layout_bits),
        is_tiles_(is_tiles),
        layout_(layout) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GmlxPackQuads"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int group_size_;
  int bits_;
  int layout_bits_;  // the packed layout's: bits_, or 5 (the 5-bit tiles) from 8-bit rows
  bool is_tiles_;
  QuadLayout layout_;  // the quads' shape (unused for tiles)
};

}  // namespace gmlx_kernels
