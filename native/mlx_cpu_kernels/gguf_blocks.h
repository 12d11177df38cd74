// The bulk of a Q4_K_M GGUF as MLX affine triplets (group 32, float16 scales and biases) at
// load, threaded over rows: Q4_K read at 4 bits, Q5_K at 8, Q2_K, Q3_K and Q6_K requantized to 8. The numpy decoders in
// gmlx/models/gguf_blocks.py, float operation for float operation (the same values), which stay
// the fallback. numpy took 1.2 ns a Q4_K value and 6-7 ns a Q6_K one (an 8B file: ~20 s).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <memory>

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace gmlx_kernels {

namespace mx = mlx::core;

// [weight (rows, values * bits / 32) uint32, scales (rows, values / 32) float16, biases] decoded
// now, on the pool, from num_rows rows of row_bytes bytes of `kind` blocks at `blocks` (a GGUF's
// bytes where they lie: a copy into an mlx array cost an 8B file ~3 s of page faults): "Q4_K"
// (144-byte blocks, 4 bits), "Q5_K" (176-byte blocks, its 5-bit levels at 8 bits), "Q3_K" (110-byte
// blocks, 8 bits), "Q2_K" (84-byte blocks, 8 bits) or "Q6_K" (210-byte blocks, 8 bits).
std::vector<mx::array> decode_gguf_blocks(const uint8_t* blocks, int64_t num_rows, int64_t row_bytes,
                                          const std::string& kind);

// num_rows rows of `kind` blocks (row_bytes each, at `blocks`, read where they lie) packed now, on
// the pool: Q4_K into the K-tile layout (int8_dot_kernels.h: kK4Bits), Q5_K into the K5-tile one
// (kK5Bits), Q6_K into the K6-tile one (kK6Bits), Q3_K into the K3-tile one (kK3Bits), Q2_K into the
// K2-tile one (kK2Bits). Under the tile layout only.
mx::array pack_k_quant_tiles(const uint8_t* blocks, int64_t num_rows, int64_t row_bytes, const std::string& kind);

// A file mapped read-only for as long as a node that reads it lives (shared by the nodes of one path).
struct MappedFile;

// The K-quant block types read here.
enum class KQuantKind { kQ2K, kQ3K, kQ4K, kQ5K, kQ6K };

// decode_gguf_blocks's triplets of the num_rows rows of `kind` blocks at byte `offset` of the file
// at `path`, as lazy graph nodes: decoded when evaluated, never where nothing evaluates them (a
// matrix the CPU kernels pack from its blocks as K-tiles). The file stays mapped while they live.
std::vector<mx::array> lazy_gguf_triplets(const std::string& path, int64_t offset, int64_t num_rows, int64_t row_bytes,
                                          const std::string& kind);

class DecodeMappedBlocks : public mx::Primitive {
 public:
  DecodeMappedBlocks(mx::Stream stream, std::shared_ptr<const MappedFile> file, int64_t offset, int64_t num_rows,
                     int64_t row_bytes, KQuantKind kind)
      : mx::Primitive(stream), file_(std::move(file)), offset_(offset), num_rows_(num_rows), row_bytes_(row_bytes),
        kind_(kind) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GmlxDecodeMappedBlocks"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  std::shared_ptr<const MappedFile> file_;
  int64_t offset_, num_rows_, row_bytes_;
  KQuantKind kind_;
};

}  // namespace gmlx_kernels
