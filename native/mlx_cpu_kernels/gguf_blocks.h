// The bulk of a Q4_K_M GGUF as MLX affine triplets (group 32, float16 scales and biases) at
// load, threaded over rows: Q4_K read at 4 bits, Q6_K requantized to 8. The numpy decoders in
// gmlx/models/gguf_blocks.py, float operation for float operation (the same values), which stay
// the fallback. numpy took 1.2 ns a Q4_K value and 6-7 ns a Q6_K one (an 8B file: ~20 s).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mlx/array.h"

namespace gmlx_kernels {

namespace mx = mlx::core;

// [weight (rows, values * bits / 32) uint32, scales (rows, values / 32) float16, biases] decoded
// now, on the pool, from num_rows rows of row_bytes bytes of `kind` blocks at `blocks` (a GGUF's
// bytes where they lie: a copy into an mlx array cost an 8B file ~3 s of page faults): "Q4_K"
// (144-byte blocks, 4 bits) or "Q6_K" (210-byte blocks, 8 bits).
std::vector<mx::array> decode_gguf_blocks(const uint8_t* blocks, int64_t num_rows, int64_t row_bytes,
                                          const std::string& kind);

// num_rows rows of `kind` blocks (row_bytes each, at `blocks`, read where they lie) packed now, on
// the pool: Q4_K into the K-tile layout (int8_dot_kernels.h: kK4Bits), Q6_K into the K6-tile one
// (kK6Bits). Under the tile layout only.
mx::array pack_k_quant_tiles(const uint8_t* blocks, int64_t num_rows, int64_t row_bytes, const std::string& kind);

}  // namespace gmlx_kernels
