// Rotary position embedding as one MLX primitive, with a position per batch row.
#pragma once

#include <string>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace gmlx_kernels {

namespace mx = mlx::core;

// mx.fast.rope's arithmetic for float32 x (B, ..., T, D): element pairs of the first
// `dims` features turn by (offset[b] + t) * scale * base^(-2i / dims), or with `freqs`
// (dims / 2 of them, mx.fast.rope's: Llama 3's scaled rope) by (offset[b] + t) * scale / freqs[i];
// offset is an int scalar or one per row b. mscale (YaRN's attention factor) multiplies the
// rotated features. The angle's cosine and sine (times mscale) come from double precision, so a
// position's rotation is the same bits in every call, whatever else it holds.
mx::array rope(const mx::array& x, int dims, bool traditional, float base, float scale, const mx::array& offset,
               const std::vector<float>& freqs = {}, float mscale = 1.0f);
// ValueError-style check of a rope's dims and freqs against a head of head_dim features.
void check_rope(int dims, const std::vector<float>& freqs, int64_t head_dim, const std::string& who);

// The rotation on raw buffers (the fused decoder-layer ops call it): x viewed as (B, M, T, D)
// at the given strides, y (B, M, T, D) contiguous; the very arithmetic of `rope`.
struct RopeArgs {
  const float* x;
  int64_t num_b, num_m, num_t, num_d;
  int64_t stride_b, stride_m, stride_t, stride_d;
  const int32_t* offsets;
  int64_t offset_stride;  // 0: one offset for every row b
  float* y;
  int dims;
  bool traditional;
  float base, scale;
  const float* freqs = nullptr;  // dims / 2 of them, or nullptr: base^(2i / dims)
  float mscale = 1.0f;  // the rotated features' factor (YaRN)
};
void rotate(const RopeArgs& args);

// Each row (b, t)'s cosines and sines, (B * T, dims / 2): what rotate turns that row's vectors
// by, from args' offsets, rows, dims, base and scale (x and y unread). A fused layer fills them
// once for its q and k, a stack once for all its layers.
struct RopeAngles {
  std::vector<float> cosines, sines;
};
void fill_rope_angles(const RopeArgs& args, RopeAngles& angles);
void rotate_with(const RopeArgs& args, const RopeAngles& angles);

class Rope : public mx::Primitive {
 public:
  Rope(mx::Stream stream, int dims, bool traditional, float base, float scale, std::vector<float> freqs,
       float mscale)
      : mx::Primitive(stream), dims_(dims), traditional_(traditional), base_(base), scale_(scale),
        freqs_(std::move(freqs)), mscale_(mscale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "GmlxRope"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int dims_;
  bool traditional_;
  float base_;
  float scale_;
  std::vector<float> freqs_;
  float mscale_;
};

}  // namespace gmlx_kernels
